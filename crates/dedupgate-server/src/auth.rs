//! Bearer-token auth: [`Auth`] holds SHA-256 digests of the configured tokens (never the tokens
//! themselves) and answers who a request is ([`Principal`]) and what it may touch.

use sha2::{Digest, Sha256};

use crate::config::{Role, TokenRule};
use crate::problem::Problem;

struct Rule {
    digest: [u8; 32],
    patterns: Vec<String>,
    role: Role,
}

/// The configured tokens. Empty means auth is off and every request may do everything.
pub struct Auth {
    rules: Vec<Rule>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Auth({} tokens)", self.rules.len())
    }
}

/// Who sent a request.
#[derive(Clone, Copy, Debug)]
pub enum Principal<'a> {
    /// Auth is off.
    Anyone,
    /// A configured token's namespace patterns and role.
    Token {
        /// Namespace globs the token may touch.
        patterns: &'a [String],
        /// client or admin.
        role: Role,
    },
}

impl Auth {
    /// Builds the digests of `tokens`.
    pub fn new(tokens: &[TokenRule]) -> Self {
        Self {
            rules: tokens
                .iter()
                .map(|t| Rule {
                    digest: Sha256::digest(t.token.as_bytes()).into(),
                    patterns: t.namespaces.clone(),
                    role: t.role,
                })
                .collect(),
        }
    }

    /// True when tokens are configured.
    pub fn enabled(&self) -> bool {
        !self.rules.is_empty()
    }

    /// Identifies the sender of an `Authorization` header value. Compares digests in constant
    /// time and always looks at every rule, so timing reveals neither a token nor its position.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Principal<'_>, Problem> {
        if !self.enabled() {
            return Ok(Principal::Anyone);
        }
        let Some(header) = authorization else {
            return Err(Problem::unauthorized("missing Authorization: Bearer token"));
        };
        let token = header
            .strip_prefix(b"Bearer ")
            .or_else(|| header.strip_prefix(b"bearer "))
            .ok_or_else(|| Problem::unauthorized("Authorization must be `Bearer TOKEN`"))?;
        let digest: [u8; 32] = Sha256::digest(token).into();
        let mut found: Option<&Rule> = None;
        for rule in &self.rules {
            if constant_time_eq(&rule.digest, &digest) && found.is_none() {
                found = Some(rule);
            }
        }
        found
            .map(|r| Principal::Token {
                patterns: &r.patterns,
                role: r.role,
            })
            .ok_or_else(|| Problem::unauthorized("unknown bearer token"))
    }
}

impl Principal<'_> {
    /// Checks that this principal may act on `namespace`; `admin` ops need the admin role.
    pub fn allows(&self, namespace: &str, admin: bool) -> Result<(), Problem> {
        match self {
            Principal::Anyone => Ok(()),
            Principal::Token { patterns, role } => {
                if admin && *role != Role::Admin {
                    return Err(Problem::forbidden("this operation needs an admin token"));
                }
                if patterns.iter().any(|p| glob_match(p, namespace)) {
                    Ok(())
                } else {
                    Err(Problem::forbidden(format!(
                        "the token may not use namespace {namespace:?}"
                    )))
                }
            }
        }
    }
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// Glob match: `*` is any run of characters (also none), `?` exactly one; all else literal.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    // Iterative matcher with one backtrack point: linear in practice, never exponential.
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(token: &str, ns: &[&str], role: Role) -> TokenRule {
        TokenRule {
            name: None,
            token: token.into(),
            namespaces: ns.iter().map(|s| s.to_string()).collect(),
            role,
        }
    }

    #[test]
    fn globs() {
        assert!(glob_match("pay*", "payments"));
        assert!(glob_match("pay*", "pay"));
        assert!(!glob_match("pay*", "xpay"));
        assert!(glob_match("*", "anything"));
        assert!(glob_match("a?c", "abc"));
        assert!(!glob_match("a?c", "ac"));
        assert!(glob_match("*.orders.*", "eu.orders.v2"));
        assert!(!glob_match("orders", "orders2"));
    }

    #[test]
    fn tokens_roles_and_namespaces() {
        let auth = Auth::new(&[
            rule("client-t", &["pay*"], Role::Client),
            rule("admin-t", &["*"], Role::Admin),
        ]);
        assert!(auth.authenticate(None).is_err());
        assert_eq!(auth.authenticate(Some(b"Basic x")).unwrap_err().status, 401);
        assert_eq!(
            auth.authenticate(Some(b"Bearer nope")).unwrap_err().status,
            401
        );
        let client = auth.authenticate(Some(b"Bearer client-t")).unwrap();
        assert!(client.allows("payments", false).is_ok());
        assert_eq!(client.allows("orders", false).unwrap_err().status, 403);
        assert_eq!(client.allows("payments", true).unwrap_err().status, 403);
        let admin = auth.authenticate(Some(b"Bearer admin-t")).unwrap();
        assert!(admin.allows("orders", true).is_ok());
        assert!(Auth::new(&[])
            .authenticate(None)
            .unwrap()
            .allows("x", true)
            .is_ok());
    }
}
