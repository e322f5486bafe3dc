//! TLS to the upstream: a local HTTPS sample API with a certificate from a throwaway CA (rcgen),
//! trusted through `ca_file` (the machine has no internet, so no public roots are involved).

mod common;

use std::sync::Arc;

use common::start_with;
use dedupgate_proxy::sample::{router, Counts};
use dedupgate_proxy::{ConfigError, IdempotencyConfig, Upstream, UpstreamConfig};
use http::StatusCode;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;

struct TlsApi {
    port: u16,
    counts: Arc<Counts>,
    ca_pem: String,
}

async fn start_tls_api() -> TlsApi {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "dedupgate test CA");
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let mut leaf_params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    leaf_params
        .subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    let leaf = leaf_params.signed_by(&leaf_key, &ca, &ca_key).unwrap();

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server_config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(leaf.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let counts = Arc::new(Counts::default());
    let app = router(counts.clone());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                // A handshake the client aborts (untrusted certificate) is expected in the test.
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req| {
                    tower_service::Service::call(&mut app.clone(), req)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    TlsApi {
        port,
        counts,
        ca_pem: ca.pem(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_upstream_with_a_configured_ca() {
    let api = start_tls_api().await;
    let dir = std::env::temp_dir().join(format!("dedupgate-proxy-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, &api.ca_pem).unwrap();

    let url = format!("https://localhost:{}", api.port);
    let trusted = {
        let (url, ca_file) = (url.clone(), ca_file.clone());
        start_with(IdempotencyConfig::default(), move |pc| {
            pc.upstream.url = url;
            pc.upstream.ca_file = Some(ca_file);
        })
        .await
    };
    let a = trusted.post("/v1/charges", "k-tls", "over tls").await;
    assert_eq!(a.status, StatusCode::CREATED, "{:?}", a.body);
    let b = trusted.post("/v1/charges", "k-tls", "over tls").await;
    assert!(b.replayed());
    assert_eq!(a.body, b.body);
    assert_eq!(a.json()["host"], format!("localhost:{}", api.port));
    assert_eq!(api.counts.of("k-tls"), 1);

    // Without the CA the certificate is refused: 502, released, never executed.
    let untrusted = start_with(IdempotencyConfig::default(), move |pc| {
        pc.upstream.url = url
    })
    .await;
    let c = untrusted.post("/v1/charges", "k-untrusted", "x").await;
    assert_eq!(c.status, StatusCode::BAD_GATEWAY, "{:?}", c.body);
    assert!(c.json()["detail"]
        .as_str()
        .unwrap()
        .to_lowercase()
        .contains("certificate"));
    assert_eq!(api.counts.of("k-untrusted"), 0);
    let d = untrusted.post("/v1/charges", "k-untrusted", "x").await;
    assert_eq!(d.status, StatusCode::BAD_GATEWAY, "released, not 409");

    // A CA file without certificates is a configuration error, not a silent default.
    let empty = dir.join("empty.pem");
    std::fs::write(&empty, "not a certificate\n").unwrap();
    let mut config = UpstreamConfig::new("https://localhost:1");
    config.ca_file = Some(empty);
    assert!(matches!(Upstream::new(&config), Err(ConfigError::Tls(_))));
    let _ = std::fs::remove_dir_all(&dir);
}
