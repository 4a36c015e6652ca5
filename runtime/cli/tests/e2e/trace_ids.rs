//! Every answer of Generate carries the request's trace id (which each process's log lines of
//! the request carry), served or refused: what a client quotes to an operator.

use handoff::ClusterConfig;
use handoff_proto::metadata::TRACE_ID;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::{GenerateRequest, SamplingParams, TokenIds};

use super::support::*;

fn request(ids: Vec<u32>, traceparent: &str) -> tonic::Request<GenerateRequest> {
    let mut req = tonic::Request::new(GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids })),
        sampling: Some(SamplingParams { max_tokens: 2, ..Default::default() }),
        ..Default::default()
    });
    req.metadata_mut().insert("traceparent", traceparent.parse().unwrap());
    req
}

#[tokio::test]
async fn a_served_or_refused_request_is_told_its_trace_id() {
    let c = cluster(ClusterConfig::ephemeral()).await;
    let mut cl = client(&c).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let served = cl.generate(request(prompt(1, 32), &traceparent)).await.unwrap();
    assert_eq!(served.metadata().get(TRACE_ID).unwrap(), trace_id);
    let refused = cl.generate(request(Vec::new(), &traceparent)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert_eq!(refused.metadata().get(TRACE_ID).unwrap(), trace_id);
    // With no traceparent, one is minted and told.
    let mut plain = tonic::Request::new(request(prompt(2, 32), &traceparent).into_inner());
    plain.metadata_mut().remove("traceparent");
    let minted = cl.generate(plain).await.unwrap();
    let id = minted.metadata().get(TRACE_ID).unwrap().to_str().unwrap().to_owned();
    assert!(id.len() == 32 && id != trace_id, "{id}");
    c.shutdown().await;
}
