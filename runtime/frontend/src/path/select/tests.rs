//! Selecting past the instances this frontend avoids.

use std::sync::Arc;

use handoff_core::Tasks;
use handoff_discovery::{Instance, Role, Update};
use handoff_engine::{MockConfig, MockEngine};
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::{GenerateRequest, TokenIds};
use handoff_scheduler::{SchedulerConfig, SchedulerState};
use tokio::net::TcpListener;

use crate::{FrontendConfig, input};

/// More instances avoided than a scheduler takes exclusions: the request is not refused as
/// invalid; the avoided ones past the bound are merely not passed over.
#[tokio::test]
async fn avoiding_more_instances_than_a_request_may_exclude_still_selects() {
    let state = Arc::new(SchedulerState::new(SchedulerConfig::default()));
    let p0 = Instance::fixture("p0".parse().unwrap(), Role::Prefill);
    state.apply_update(Update::Reset(vec![p0]));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let tasks = Tasks::new();
    tasks.spawn(handoff_scheduler::service::serve(listener, state, async {
        let _ = stopped.await;
    }));
    let engine = Arc::new(MockEngine::new(MockConfig::default()));
    let fe = super::Frontend::new(FrontendConfig::default(), engine.clone(), &[addr], &tasks)
        .await
        .unwrap();
    let now = tokio::time::Instant::now();
    for i in 0..2 * handoff_proto::select::MAX_EXCLUDE {
        let gone = format!("gone-{i}");
        while !fe.reach.failed_at(&gone, now) {}
    }
    let req = GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: (1..40).collect() })),
        ..Default::default()
    };
    let plan = input::plan(req, &*engine, &FrontendConfig::default()).unwrap();
    let (_lease, selected) =
        fe.select_reachable(&plan, &[1, 2], &[], &[]).await.expect("p0 is selected");
    assert_eq!(selected.selection.instance_id, "p0");
    drop(stop);
    tasks.shutdown().await;
}

/// An instance this frontend avoids (it could not reach it: a process killed, say) and that
/// registers again (its restart) is tried at once, not after the avoidance's 10 s.
#[tokio::test]
async fn an_instance_registering_again_is_no_longer_avoided() {
    let tasks = Tasks::new();
    let engine = Arc::new(MockEngine::new(MockConfig::default()));
    let fe = super::Frontend::new(FrontendConfig::default(), engine, &[], &tasks).await.unwrap();
    let registry = Arc::new(handoff_discovery::MemoryRegistry::new());
    fe.follow(registry.clone()).await.unwrap();
    let now = tokio::time::Instant::now();
    while !fe.reach.failed_at("p0", now) {}
    assert_eq!(fe.reach.avoided_at(now), ["p0"]);
    let p0 = Instance::fixture("p0".parse().unwrap(), Role::Prefill);
    handoff_discovery::Registry::register(&*registry, p0).await.unwrap();
    let since = std::time::Instant::now();
    while !fe.reach.avoided_at(now).is_empty() {
        assert!(since.elapsed() < std::time::Duration::from_secs(5), "still avoided");
        tokio::task::yield_now().await;
    }
    tasks.shutdown().await;
}

/// A registration is a process started: what the last one at its address said it takes
/// (the decode's handshakes in the call) is forgotten, so a rollback to a build that does
/// not is asked the old way.
#[tokio::test]
async fn an_instance_registering_again_is_asked_again_what_it_takes() {
    let tasks = Tasks::new();
    let engine = Arc::new(MockEngine::new(MockConfig::default()));
    let fe = super::Frontend::new(FrontendConfig::default(), engine, &[], &tasks).await.unwrap();
    let registry = Arc::new(handoff_discovery::MemoryRegistry::new());
    fe.follow(registry.clone()).await.unwrap();
    let p0 = Instance::fixture("p0".parse().unwrap(), Role::Prefill);
    let peer = fe.prefill_client(&p0.grpc_addr).unwrap();
    peer.learn("p0", true);
    assert!(peer.takes_handshakes("p0"));
    handoff_discovery::Registry::register(&*registry, p0).await.unwrap();
    let since = std::time::Instant::now();
    while peer.takes_handshakes("p0") {
        assert!(since.elapsed() < std::time::Duration::from_secs(5), "still remembered");
        tokio::task::yield_now().await;
    }
    tasks.shutdown().await;
}
