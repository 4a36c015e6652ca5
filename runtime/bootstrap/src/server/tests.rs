//! BOOTSTRAP.md's observed SGLang transcript, reproduced status for status and body for body,
//! plus the inputs where we answer 400 (SGLang: 500) and the token checks.

use axum::body::Body;
use axum::http::{Method, Request};
use http_body_util::BodyExt;
use serde_json::json;
use tower::ServiceExt;

use super::*;
use crate::DirectoryConfig;

async fn call(
    app: &Router,
    method: Method,
    uri: &str,
    body: Option<Value>,
    token: Option<&str>,
) -> (u16, String, String) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let body = body.map(|b| Body::from(b.to_string())).unwrap_or_else(Body::empty);
    let resp = app.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = resp.status().as_u16();
    let ctype = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap(), ctype)
}

fn reg(tp_rank: i64, port: i64) -> Value {
    json!({
        "attn_tp_size": 2, "attn_tp_rank": tp_rank, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": port,
        "page_size": 64, "kv_cache_dtype": "auto", "some_future_key": [1, 2]
    })
}

const ALL: &str =
    "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1";

fn rank_uri(tp: i64) -> String {
    format!("/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={tp}&target_pp_rank=0")
}

#[tokio::test]
async fn sglang_transcript_is_reproduced() {
    let app = router(Arc::new(Directory::new(DirectoryConfig::default())));
    let not_ready =
        |n| format!("Prefill server not fully registered yet ({n} workers registered).");

    let (s, b, ct) = call(&app, Method::GET, "/health", None, None).await;
    assert_eq!((s, b.as_str(), ct.as_str()), (200, "OK", "text/plain; charset=utf-8"));
    assert_eq!(call(&app, Method::GET, ALL, None, None).await.0, 503);
    assert_eq!(call(&app, Method::GET, ALL, None, None).await.1, not_ready(0));
    let (s, b, _) = call(&app, Method::GET, "/route?prefill_dp_rank=0", None, None).await;
    assert_eq!((s, b.as_str()), (400, "Missing inputs for bootstrap server."));
    let (s, b, _) = call(&app, Method::DELETE, "/route", None, None).await;
    assert_eq!((s, b.as_str()), (405, "Method not allowed"));
    let (s, b, _) = call(&app, Method::PUT, "/route", Some(reg(0, 40000)), None).await;
    assert_eq!((s, b.as_str()), (200, "OK"));
    assert_eq!(call(&app, Method::GET, ALL, None, None).await.1, not_ready(1));
    let (s, b, _) = call(&app, Method::GET, &rank_uri(0), None, None).await;
    assert_eq!((s, b), (503, not_ready(1)), "503 until ready, even for a registered rank");

    let mut bad = reg(1, 40001);
    bad["decode_allocation_policy"] = json!("prefill_complete");
    let (s, b, _) = call(&app, Method::PUT, "/route", Some(bad), None).await;
    assert_eq!((s, b.as_str()), (400, "Inconsistent prefill allocation policies"));

    assert_eq!(call(&app, Method::PUT, "/route", Some(reg(1, 40001)), None).await.0, 200);
    let (s, b, ct) = call(&app, Method::GET, ALL, None, None).await;
    assert_eq!((s, ct.as_str()), (200, "application/json"));
    let info: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        info,
        json!({"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 64,
               "kv_cache_dtype": "auto", "follow_bootstrap_room": true,
               "target_tp_rank": null, "target_tp_ranks": null, "target_cp_ranks": null,
               "target_pp_ranks": null, "required_dst_info_num": null,
               "required_prefill_response_num": null})
    );
    let (s, b, _) = call(&app, Method::GET, &rank_uri(1), None, None).await;
    assert_eq!(
        (s, serde_json::from_str::<Value>(&b).unwrap()),
        (200, json!({"rank_ip": "127.0.0.1", "rank_port": 40001}))
    );
    let (s, b, _) = call(&app, Method::GET, &rank_uri(7), None, None).await;
    assert_eq!(
        (s, b.as_str()),
        (404, "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=7 pp_rank=0")
    );

    assert_eq!(call(&app, Method::PUT, "/route", Some(reg(0, 40002)), None).await.0, 200);
    let (_, b, _) = call(&app, Method::GET, &rank_uri(0), None, None).await;
    assert_eq!(serde_json::from_str::<Value>(&b).unwrap()["rank_port"], 40002);

    let body = json!({"bootstrap_room": 12345678901234u64, "dp_rank": 1});
    let (s, b, _) = call(&app, Method::POST, "/register_dp_rank", Some(body), None).await;
    assert_eq!((s, b.as_str()), (200, "OK"));
    let body = json!({"bootstrap_rooms": [12345678901234u64, 42, 7]});
    let (s, b, _) = call(&app, Method::POST, "/query_dp_ranks", Some(body), None).await;
    assert_eq!(
        (s, serde_json::from_str::<Value>(&b).unwrap()),
        (200, json!({"12345678901234": 1}))
    );
    assert_eq!(call(&app, Method::GET, "/register_dp_rank", None, None).await.0, 405);
}

#[tokio::test]
async fn malformed_inputs_get_400_with_a_reason() {
    let app = router(Arc::new(Directory::new(DirectoryConfig::default())));
    let uri = "/route?prefill_dp_rank=x&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0";
    let (s, b, _) = call(&app, Method::GET, uri, None, None).await;
    assert_eq!(s, 400);
    assert!(b.contains("prefill_dp_rank must be an integer"), "{b}");
    let uri = "/route?prefill_dp_rank=&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0";
    assert_eq!(
        call(&app, Method::GET, uri, None, None).await.1,
        "Missing inputs for bootstrap server."
    );

    let mut missing = reg(0, 40000);
    missing.as_object_mut().unwrap().remove("rank_port");
    let (s, b, _) = call(&app, Method::PUT, "/route", Some(missing), None).await;
    assert_eq!(s, 400);
    assert!(b.contains("rank_port"), "{b}");
    let (s, _, _) = call(&app, Method::PUT, "/route", Some(json!("nope")), None).await;
    assert_eq!(s, 400);

    for body in [
        json!({"dp_rank": 1}),
        json!({"bootstrap_room": "abc", "dp_rank": 1}),
        json!({"bootstrap_room": 5, "dp_rank": -1}),
        json!({"bootstrap_room": 0, "dp_rank": 1}),
    ] {
        assert_eq!(call(&app, Method::POST, "/register_dp_rank", Some(body), None).await.0, 400);
    }
    let body = json!({"bootstrap_room": "77", "dp_rank": "2"});
    assert_eq!(
        call(&app, Method::POST, "/register_dp_rank", Some(body), None).await.0,
        200,
        "decimal strings accepted"
    );
    for body in [json!({}), json!({"bootstrap_rooms": 5}), json!({"bootstrap_rooms": [1.5]})] {
        assert_eq!(call(&app, Method::POST, "/query_dp_ranks", Some(body), None).await.0, 400);
    }

    // An SGLang decode waiting on 5,000 rooms asks for them all at once (about 100 KiB):
    // every one answered (up to 65,536, more than 1 MiB of them holds).
    let body = json!({"bootstrap_room": 9_000_000_000_000_004_095u64, "dp_rank": 1});
    assert_eq!(call(&app, Method::POST, "/register_dp_rank", Some(body), None).await.0, 200);
    let body = json!({"bootstrap_room": 9_000_000_000_000_004_096u64, "dp_rank": 1});
    assert_eq!(call(&app, Method::POST, "/register_dp_rank", Some(body), None).await.0, 200);
    let many: Vec<u64> = (0..5000).map(|i| 9_000_000_000_000_000_000 + i).collect();
    let body = json!({ "bootstrap_rooms": many });
    let (s, b, _) = call(&app, Method::POST, "/query_dp_ranks", Some(body), None).await;
    assert_eq!(
        (s, serde_json::from_str::<Value>(&b).unwrap()),
        (200, json!({"9000000000000004095": 1, "9000000000000004096": 1}))
    );
    let huge = json!({"bootstrap_rooms": vec![1u64; 600_000]});
    assert_eq!(call(&app, Method::POST, "/query_dp_ranks", Some(huge), None).await.0, 413);
    let big = json!({"bootstrap_room": 1, "dp_rank": 1, "pad": "x".repeat(100_000)});
    assert_eq!(call(&app, Method::POST, "/register_dp_rank", Some(big), None).await.0, 413);
    assert_eq!(call(&app, Method::GET, "/health", None, None).await.0, 200, "still serving");
}

#[tokio::test]
async fn writes_need_the_token_when_configured() {
    let dir = Directory::new(DirectoryConfig { token: Some("t0k".into()), ..Default::default() });
    let app = router(Arc::new(dir));
    let (s, b, _) = call(&app, Method::PUT, "/route", Some(reg(0, 40000)), None).await;
    assert_eq!((s, b.as_str()), (401, "Unauthorized"));
    assert_eq!(call(&app, Method::PUT, "/route", Some(reg(0, 40000)), Some("wrong")).await.0, 401);
    assert_eq!(call(&app, Method::PUT, "/route", Some(reg(0, 40000)), Some("t0k")).await.0, 200);
    let body = json!({"bootstrap_room": 5, "dp_rank": 0});
    assert_eq!(
        call(&app, Method::POST, "/register_dp_rank", Some(body.clone()), None).await.0,
        401
    );
    assert_eq!(call(&app, Method::POST, "/register_dp_rank", Some(body), Some("t0k")).await.0, 200);
    // Reads stay open, as in SGLang.
    assert_eq!(call(&app, Method::GET, ALL, None, None).await.0, 503);
    // The scheme's name in any case, as SGLang takes it; nothing but the token after it.
    let d = Directory::new(DirectoryConfig { token: Some("t0k".into()), ..Default::default() });
    for (header, ok) in
        [("bearer t0k", true), ("BEARER t0k", true), ("Basic t0k", false), ("bearer  t0k", false)]
    {
        assert_eq!(d.authorize(Some(header)).is_ok(), ok, "{header}");
    }
}

#[tokio::test]
async fn client_reads_a_directory_over_a_real_socket() {
    let dir = Arc::new(Directory::new(DirectoryConfig::default()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(run(listener, dir, async {
        let _ = rx.await;
    }));
    let client = crate::DirectoryClient::default();
    assert!(matches!(client.server_info(&addr).await, Err(crate::ClientError::NotReady { .. })));
    for (tp, port) in [(0, 40000), (1, 40001)] {
        client.register(&addr, &serde_json::from_value(reg(tp, port)).unwrap()).await.unwrap();
    }
    let cache = crate::DirectoryCache::new(client);
    assert_eq!(cache.server_info("p0", &addr).await.unwrap().attn_tp_size, 2);
    assert_eq!(cache.rank("p0", &addr, (0, 0, 1, 0)).await.unwrap().rank_port, 40001);
    assert!(cache.rank("p0", &addr, (0, 0, 9, 0)).await.is_err());
    tx.send(()).unwrap();
    server.await.unwrap().unwrap();
    // Cached answers survive the directory going away, until invalidated.
    assert_eq!(cache.rank("p0", &addr, (0, 0, 1, 0)).await.unwrap().rank_port, 40001);
    cache.invalidate("p0");
    assert!(cache.server_info("p0", &addr).await.is_err());
}

/// Over the cluster's TLS, a client whose own bundle loses the directory's CA reads nothing
/// more from it: not over the connection it kept, nor over a new one.
#[tokio::test]
async fn a_directory_of_a_ca_taken_out_is_read_no_more() {
    use handoff_core::tls::test_certs::{CertFiles, TestCa};
    let (kept, removed) = (TestCa::new(), TestCa::new());
    let both = format!("{}{}", kept.pem(), removed.pem());
    let tls = Some(removed.issue().trusting(&both));
    let dir = Arc::new(Directory::new(DirectoryConfig { tls, ..Default::default() }));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(run(listener, dir, async {
        let _ = rx.await;
    }));
    let files = CertFiles::new(&kept.issue(), &both);
    let client_tls = files.cluster();
    let client = crate::DirectoryClient::with_tls(None, Some(&client_tls));
    for (tp, port) in [(0, 40000), (1, 40001)] {
        client.register(&addr, &serde_json::from_value(reg(tp, port)).unwrap()).await.unwrap();
    }
    assert_eq!(client.server_info(&addr).await.unwrap().attn_tp_size, 2);

    files.put("ca.crt", kept.pem());
    let taken = client_tls.reload(std::time::SystemTime::now()).unwrap();
    assert_eq!(taken, handoff_core::tls::Reloaded::Taken);
    assert!(client.server_info(&addr).await.is_err(), "its server no longer trusted");
    tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}

/// Past `max_query_rooms`, a list is answered for its first rooms only (the decode asks
/// again for the rest), not refused.
#[tokio::test]
async fn a_list_past_the_bound_is_answered_for_its_first_rooms() {
    let dir = Directory::new(DirectoryConfig { max_query_rooms: 2, ..Default::default() });
    let app = router(Arc::new(dir));
    for room in [1u64, 2, 3] {
        let body = json!({"bootstrap_room": room, "dp_rank": 0});
        assert_eq!(call(&app, Method::POST, "/register_dp_rank", Some(body), None).await.0, 200);
    }
    let body = json!({"bootstrap_rooms": [3, 1, 2]});
    let (s, b, _) = call(&app, Method::POST, "/query_dp_ranks", Some(body), None).await;
    assert_eq!((s, serde_json::from_str::<Value>(&b).unwrap()), (200, json!({"3": 0, "1": 0})));
}
