use super::*;

fn engine() -> MockEngine {
    MockEngine::new(MockConfig::default())
}

async fn generate(e: &MockEngine, prompt: &[u32], prefix: Option<Kv>, n: usize) -> Vec<u32> {
    let p = e.prefill(prompt, prefix, &Sampling::default()).await.unwrap();
    let mut out = vec![p.first_token];
    let mut d = e.decoder(p.kv, p.first_token, &Sampling::default()).unwrap();
    for _ in 1..n {
        out.push(d.step().await.unwrap());
    }
    out
}

#[tokio::test]
async fn cached_prefix_gives_the_same_kv_and_tokens() {
    let e = engine();
    let prompt: Vec<u32> = (10..60).collect();
    let full = e.prefill(&prompt, None, &Sampling::default()).await.unwrap();
    let prefix = full.kv.slice_tokens(0..32);
    let again = e.prefill(&prompt, Some(prefix.clone()), &Sampling::default()).await.unwrap();
    assert_eq!(full.kv, again.kv);
    assert_eq!(generate(&e, &prompt, None, 8).await, generate(&e, &prompt, Some(prefix), 8).await);
}

#[tokio::test]
async fn one_flipped_kv_byte_changes_the_tokens() {
    let e = engine();
    let prompt: Vec<u32> = (10..40).collect();
    let p = e.prefill(&prompt, None, &Sampling::default()).await.unwrap();
    let mut bytes = p.kv.layers().concat();
    bytes[100] ^= 1;
    let bad = Kv::from_bytes(p.kv.shape(), p.kv.tokens(), bytes).unwrap();
    let mut good = e.decoder(p.kv, p.first_token, &Sampling::default()).unwrap();
    let mut wrong = e.decoder(bad, p.first_token, &Sampling::default()).unwrap();
    assert_ne!(good.step().await.unwrap(), wrong.step().await.unwrap());
}

#[tokio::test]
async fn bad_prompts_are_rejected() {
    let e = engine();
    assert!(e.prefill(&[], None, &Sampling::default()).await.is_err());
    let long = vec![5u32; 9000];
    assert!(matches!(
        e.prefill(&long, None, &Sampling::default()).await,
        Err(EngineError::InvalidInput(_))
    ));
}

#[test]
fn tokenize_round_trips_rendered_ids() {
    let e = engine();
    let toks = e.tokenize("hello world").unwrap();
    assert_eq!(e.tokenize(&e.detokenize(&toks)).unwrap(), toks);
}

#[test]
fn the_digest_is_of_the_canonical_bytes_whatever_buffers_hold_them() {
    // Short inputs (xxh3's own paths up to 240 bytes), and layers longer than the streaming
    // hasher's 256-byte buffer.
    let shapes = [
        KvShape { layers: 1, kv_heads: 1, head_bytes: 8 },
        KvShape { layers: 3, kv_heads: 2, head_bytes: 8 },
        MockConfig::default().shape,
    ];
    for shape in shapes {
        for n in 0..8 {
            let tokens: Vec<u32> = (7..7 + n).collect();
            let kv = MockEngine::compute_kv(shape, &tokens, 3);
            let flat = kv.layers().concat();
            let layers = kv.layers().iter().map(|l| bytes::Bytes::copy_from_slice(l)).collect();
            let apart = Kv::from_layers(shape, tokens.len(), layers).unwrap();
            for seed in [0, 42] {
                let want = xxhash_rust::xxh3::xxh3_64_with_seed(&flat, seed);
                assert_eq!(digest(&kv, seed), want, "{shape:?}, {n} tokens, seed {seed}");
                assert_eq!(digest(&apart, seed), want, "{shape:?}, {n} tokens, seed {seed}");
            }
            assert_eq!(digest(&kv, 0), xxh3_64(&flat));
        }
    }
}

#[tokio::test]
async fn streamed_layers_are_the_kvs_own_bytes() {
    crate::tests::streams_the_kvs_own_layers(&engine()).await;
}
