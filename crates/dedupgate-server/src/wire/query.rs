//! The query string of `GET`/`DELETE /v1/record`: its `namespace` and `key`, form-decoded and
//! strict about UTF-8.

use serde::Deserialize;

use crate::problem::Problem;

/// The identity fields of `GET`/`DELETE /v1/record` (query string) and of batch get/forget.
#[derive(Debug, Deserialize)]
pub struct RecordReq {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
}

/// The `namespace` and `key` of a `GET`/`DELETE /v1/record` query string, form-decoded (`%XX`
/// escapes, `+` for a space; other parameters are ignored). Decoded bytes that are not UTF-8
/// are refused, not replaced with U+FFFD: a lossy decoding would name another record. A
/// parameter given twice is refused too, since either value could be meant.
pub fn record_query(query: Option<&str>) -> Result<RecordReq, Problem> {
    let mut namespace = None;
    let mut key = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = form_decode(name)
            .map_err(|_| Problem::invalid("a query parameter name is not UTF-8 once decoded"))?;
        let slot = match name.as_str() {
            "namespace" => &mut namespace,
            "key" => &mut key,
            _ => continue,
        };
        if slot.is_some() {
            return Err(Problem::invalid(format!(
                "query parameter `{name}` is given more than once"
            )));
        }
        *slot = Some(form_decode(value).map_err(|e| {
            Problem::invalid(format!(
                "query parameter `{name}` is not UTF-8 once percent-decoded (invalid byte at \
                 {}): percent-encode the UTF-8 bytes of the text",
                e.utf8_error().valid_up_to()
            ))
        })?);
    }
    match (namespace, key) {
        (Some(namespace), Some(key)) => Ok(RecordReq { namespace, key }),
        (None, _) => Err(Problem::invalid(
            "query must carry namespace and key: `namespace` is missing",
        )),
        (_, None) => Err(Problem::invalid(
            "query must carry namespace and key: `key` is missing",
        )),
    }
}

/// `application/x-www-form-urlencoded` decoding of one name or value, strict about UTF-8. A `%`
/// not followed by two hex digits stays as it is (as in the URL standard).
fn form_decode(text: &str) -> Result<String, std::string::FromUtf8Error> {
    fn hex(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let pair = bytes
                    .get(i + 1)
                    .and_then(|&h| hex(h))
                    .zip(bytes.get(i + 2).and_then(|&l| hex(l)));
                if let Some((h, l)) = pair {
                    out.push(h << 4 | l);
                    i += 3;
                    continue;
                }
                out.push(b'%');
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_queries_decode_exactly_or_are_refused() {
        let q = record_query(Some("namespace=t4&key=a%20b+c%E2%82%AC%zz&x=%FF")).unwrap();
        assert_eq!((q.namespace.as_str(), q.key.as_str()), ("t4", "a b c€%zz"));
        for bad in [
            "namespace=t4&key=%FF",
            "namespace=t4&key=%FE",
            "namespace=%C3&key=k",
            "namespace=t4",
            "key=k",
            "namespace=t4&key=a&key=b",
        ] {
            let problem = record_query(Some(bad)).unwrap_err();
            assert_eq!(problem.status, 400, "{bad}: {problem:?}");
        }
        assert!(record_query(None).is_err());
    }
}
