//! The actuator's HTTP exchange against a stand-in API server (no real one runs on this
//! machine): a TLS server with a certificate of its own CA that checks each request as the
//! Kubernetes API documents the scale subresource (method, path, content type, body, bearer
//! token) and answers as the API server does: a `Scale` (autoscaling/v1), or a `Status` for
//! a refused call.

use super::*;
use kvmesh_planner::RoleSwitches;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::PrivateKeyDer;
use std::sync::Mutex;
use tokio::net::TcpListener;

const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.planner-token";
const NAMESPACE: &str = "kvmesh";

/// A request as the stand-in server received it.
#[derive(Clone, Debug, PartialEq)]
struct Seen {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: serde_json::Value,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A stand-in API server on 127.0.0.1: its CA (PEM), its port, and the requests it saw.
struct ApiServer {
    ca_pem: String,
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
}

/// Starts the server. Deployments named in `forbidden` are refused (403) as RBAC refuses
/// a ServiceAccount without `patch` on `deployments/scale`.
async fn api_server(forbidden: &'static [&'static str]) -> ApiServer {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap(),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let mut tls = acceptor.accept(tcp).await.unwrap();
            let request = read_request(&mut tls).await;
            let (status, answer) = answer(&request, forbidden);
            log.lock().unwrap().push(request);
            let body = answer.to_string();
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            );
            tls.write_all(response.as_bytes()).await.unwrap();
            tls.shutdown().await.unwrap();
        }
    });
    ApiServer {
        ca_pem: ca.pem(),
        port,
        seen,
    }
}

async fn read_request(tls: &mut tokio_rustls::server::TlsStream<tokio::net::TcpStream>) -> Seen {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tls.read(&mut buf).await.unwrap();
        raw.extend_from_slice(&buf[..n]);
        let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
            assert!(n > 0, "the request ended in its headers");
            continue;
        };
        let head = String::from_utf8(raw[..end].to_vec()).unwrap();
        let mut lines = head.split("\r\n");
        let mut start = lines.next().unwrap().split(' ');
        let (method, path) = (start.next().unwrap(), start.next().unwrap());
        let headers: Vec<(String, String)> = lines
            .map(|l| {
                let (k, v) = l.split_once(':').unwrap();
                (k.trim().to_string(), v.trim().to_string())
            })
            .collect();
        let length: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .map_or(0, |(_, v)| v.parse().unwrap());
        if raw.len() - end - 4 < length {
            assert!(n > 0, "the request ended in its body");
            continue;
        }
        return Seen {
            method: method.into(),
            path: path.into(),
            headers,
            body: serde_json::from_slice(&raw[end + 4..end + 4 + length]).unwrap(),
        };
    }
}

/// What the API server answers: the Scale after the patch, or a Status saying why not.
fn answer(request: &Seen, forbidden: &[&str]) -> (&'static str, serde_json::Value) {
    let prefix = format!("/apis/apps/v1/namespaces/{NAMESPACE}/deployments/");
    let name = request
        .path
        .strip_prefix(&prefix)
        .and_then(|rest| rest.strip_suffix("/scale"))
        .unwrap_or("?");
    let status = |code, reason, message: String| {
        serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason, "code": code})
    };
    if request.header("authorization") != Some(&format!("Bearer {TOKEN}")) {
        return (
            "401 Unauthorized",
            status(401, "Unauthorized", "Unauthorized".into()),
        );
    }
    if forbidden.contains(&name) {
        let message = format!(
            "deployments.apps \"{name}\" is forbidden: User \"system:serviceaccount:kvmesh:planner\" \
             cannot patch resource \"deployments/scale\" in API group \"apps\" in the namespace \"{NAMESPACE}\""
        );
        return ("403 Forbidden", status(403, "Forbidden", message));
    }
    let replicas = request.body["spec"]["replicas"].clone();
    let scale = serde_json::json!({
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": NAMESPACE, "resourceVersion": "4242"},
        "spec": {"replicas": replicas},
        "status": {"replicas": 1,
                   "selector": format!("app.kubernetes.io/component={name},app.kubernetes.io/name=kvmesh")},
    });
    ("200 OK", scale)
}

fn actuator(server: &ApiServer, token: &tempfile::NamedTempFile) -> KubernetesActuator {
    let api = KubeApi::new(
        "127.0.0.1",
        &server.port.to_string(),
        server.ca_pem.as_bytes(),
        token.path().to_path_buf(),
    )
    .unwrap();
    KubernetesActuator::new(
        api,
        NAMESPACE.into(),
        ["prefill".to_string(), "decode".to_string()],
    )
}

fn token_file() -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    // As mounted: the token may end in a newline, which is not part of it.
    std::fs::write(file.path(), format!("{TOKEN}\n")).unwrap();
    file
}

/// A decision that moves one node from decode to prefill (the actuator sets replicas only).
fn decision(prefill: (u32, u32), decode: (u32, u32)) -> Decision {
    let switches = RoleSwitches {
        prefill_to_decode: 0,
        decode_to_prefill: 1,
    };
    crate::planner::testing::decision(prefill, decode, switches)
}

#[tokio::test]
async fn a_decision_patches_each_changed_deployments_scale_as_the_api_documents() {
    let server = api_server(&[]).await;
    let token = token_file();
    let mut kube = actuator(&server, &token);
    // A switch of one decode node to prefill: one more prefill pod, one fewer decode pod.
    kube.apply(&decision((1, 2), (3, 2)), &[]).await.unwrap();
    let seen = server.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:#?}");
    for (request, (name, replicas)) in seen.iter().zip([("prefill", 2), ("decode", 2)]) {
        assert_eq!(request.method, "PATCH");
        assert_eq!(
            request.path,
            format!("/apis/apps/v1/namespaces/kvmesh/deployments/{name}/scale")
        );
        assert_eq!(
            request.header("content-type"),
            Some("application/merge-patch+json")
        );
        assert_eq!(request.header("accept"), Some("application/json"));
        assert_eq!(
            request.header("host"),
            Some(&*format!("127.0.0.1:{}", server.port))
        );
        assert_eq!(
            request.header("authorization"),
            Some(&*format!("Bearer {TOKEN}"))
        );
        assert_eq!(
            request.body,
            serde_json::json!({"spec": {"replicas": replicas}})
        );
    }
    // The pods asked for count as starting until they register.
    let registered = [crate::planner::testing::node(
        1,
        kvmesh_common::NodeRole::Prefill,
        0,
        0,
        0,
    )];
    assert_eq!(kube.starting(&registered), [1, 2]);

    // A role whose count holds is not touched.
    kube.apply(&decision((2, 2), (2, 3)), &[]).await.unwrap();
    let seen = server.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3);
    assert!(seen[2].path.ends_with("/deployments/decode/scale"));
    assert_eq!(seen[2].body["spec"]["replicas"], 3);
}

#[tokio::test]
async fn a_refused_patch_is_an_error_that_says_why_and_the_other_role_still_scales() {
    let server = api_server(&["prefill"]).await;
    let token = token_file();
    let mut kube = actuator(&server, &token);
    let e = kube
        .apply(&decision((1, 2), (1, 2)), &[])
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("403") && e.contains("cannot patch resource \"deployments/scale\""),
        "{e}"
    );
    let seen = server.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "the decode Deployment is still scaled");
    assert!(seen[1].path.ends_with("/deployments/decode/scale"));

    // A wrong token: the API server's 401 comes back as the error.
    std::fs::write(token.path(), "not-the-token").unwrap();
    let e = kube.api.scale(NAMESPACE, "decode", 1).await.unwrap_err();
    assert!(e.to_string().contains("401"), "{e}");
}

#[test]
fn a_chunked_answer_is_read_whole() {
    let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n";
    let (status, body) = parse_response(raw).unwrap();
    assert_eq!((status, &body[..]), (200, &b"{\"a\":1}"[..]));
    let short = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}";
    assert!(
        parse_response(short).is_err(),
        "a body cut short is refused"
    );
}
