//! `handoff scheduler --engine ...`: an engine instance followed through its KV events (a
//! publisher speaking vLLM 0.33's frames, played by a Rust PUB socket) is chosen for the
//! prompts it holds, with their cached blocks, over the Scheduler gRPC API.

use std::time::Duration;

use bytes::Bytes;
use handoff_core::block_hashes;
use handoff_proto::v1::SelectPrefillRequest;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use rmpv::Value;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use super::processes::addr_after;
use super::servers::{Handoff, free_port};

fn stored(hash: u64, parent: Option<u64>, tokens: &[u32], block: u32) -> Bytes {
    let ev = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array(
                tokens
                    .chunks(block as usize)
                    .enumerate()
                    .map(|(i, _)| (hash + i as u64).into())
                    .collect(),
            ),
        ),
        ("parent_block_hash".into(), parent.map_or(Value::Nil, Value::from)),
        ("token_ids".into(), Value::Array(tokens.iter().map(|&t| t.into()).collect())),
        ("block_size".into(), block.into()),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
    ]);
    let batch = Value::Array(vec![1.0.into(), Value::Array(vec![ev]), 0.into()]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out.into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_routes_to_an_engine_by_its_kv_events() {
    let port = free_port();
    let mut publisher = PubSocket::new();
    publisher.bind(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    let spec = format!("id=vllm-a,events=tcp://127.0.0.1:{port},url=127.0.0.1:8000,model=m");
    let (_s, line) = Handoff::spawn(&["scheduler", "--listen", "127.0.0.1:0", "--engine", &spec]);
    let addr = addr_after(&line, "grpc://");
    let mut client = SchedulerClient::connect(format!("http://{addr}")).await.unwrap();

    // vLLM blocks of 32 tokens; our pages of 16: 4 engine blocks hold 8 of our pages.
    let prompt: Vec<u32> = (4000..4128).collect();
    let hashes: Vec<u64> = block_hashes(&prompt, 16).into_iter().map(|h| h.0).collect();
    let payload = stored(77, None, &prompt, 32);
    let ask = || SelectPrefillRequest {
        block_hashes: hashes.clone(),
        prompt_tokens: prompt.len() as u32,
        ..Default::default()
    };
    let mut chosen = None;
    for seq in 0..100u64 {
        // Published until the subscriber has joined (seq 0 first, then the same blocks again).
        let frames =
            vec![Bytes::from("kv"), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
        publisher.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let sel = client.select_prefill(ask()).await.unwrap().into_inner();
        if sel.cached_blocks == 8 {
            chosen = Some(sel);
            break;
        }
    }
    let sel = chosen.expect("the engine's blocks reached the index");
    assert_eq!((sel.instance_id.as_str(), sel.prefill_addr.as_str()), ("vllm-a", "127.0.0.1:8000"));
}
