use super::*;

const SHAPE: KvShape = KvShape { layers: 2, kv_heads: 6, head_bytes: 8 };

/// A KV whose every byte says where it is.
fn numbered(tokens: usize) -> Kv {
    let data = (0..SHAPE.token_bytes() * tokens).map(|i| (i * 7 + i / 251) as u8).collect();
    Kv::from_bytes(SHAPE, tokens, data).unwrap()
}

fn meta(layout: &str, block_size: u64, ranks: usize) -> AgentMetadata {
    let len = (SHAPE.kv_heads / ranks) as u64 * block_size * 2 * SHAPE.head_bytes as u64;
    AgentMetadata {
        engine_id: "e".into(),
        agent_metadata: Vec::new(),
        kv_caches_base_addr: vec![4096; SHAPE.layers],
        num_blocks: 64,
        block_lens: vec![len; SHAPE.layers],
        block_strides: vec![len; SHAPE.layers],
        kv_cache_layout: layout.into(),
        block_size,
        attn_backend_name: "FLASH_ATTN".into(),
    }
}

/// What rank `rank` of `ranks` reads for `kv`: written here element by element from vLLM's
/// description (`[head][token][K|V]` or `[token][head][K|V]`), independently of the code.
fn blocks_of(kv: &Kv, layout: &str, block_size: usize, rank: usize, ranks: usize) -> Blocks {
    let heads = SHAPE.kv_heads / ranks;
    let hb = SHAPE.head_bytes;
    let blocks = kv.tokens().div_ceil(block_size);
    let mut bytes = Vec::new();
    let mut region_starts = Vec::new();
    for layer in 0..SHAPE.layers {
        region_starts.push(bytes.len());
        for b in 0..blocks {
            let mut block = vec![0xEEu8; heads * block_size * 2 * hb];
            for t in 0..block_size {
                let token = b * block_size + t;
                if token >= kv.tokens() {
                    continue; // the block's tail: whatever the cache held
                }
                for h in 0..heads {
                    let at = match layout {
                        "LBHNC" | "HND" => (h * block_size + t) * 2 * hb,
                        _ => (t * heads + h) * 2 * hb,
                    };
                    let head = rank * heads + h;
                    block[at..at + hb].copy_from_slice(&kv.run(layer, 0, head)[token * hb..][..hb]);
                    block[at + hb..at + 2 * hb]
                        .copy_from_slice(&kv.run(layer, 1, head)[token * hb..][..hb]);
                }
            }
            bytes.extend(block);
        }
    }
    Blocks { bytes, region_starts }
}

#[test]
fn blocks_of_every_layout_and_tp_become_the_canonical_kv() {
    for layout in ["LBHNC", "LBNHC", "HND", "NHD"] {
        for ranks in [1, 2, 3] {
            for tokens in [1, 15, 16, 37] {
                let kv = numbered(tokens);
                let metas: Vec<_> = (0..ranks).map(|_| meta(layout, 16, ranks)).collect();
                let reads: Vec<_> =
                    (0..ranks).map(|r| blocks_of(&kv, layout, 16, r, ranks)).collect();
                let pairs: Vec<_> = metas.iter().zip(&reads).collect();
                let got = kv_from_ranks(SHAPE, tokens, &pairs).unwrap();
                assert!(got == kv, "{layout}, tp {ranks}, {tokens} tokens");
            }
        }
    }
}

#[test]
fn caches_this_decode_cannot_read_are_refused_with_the_reason() {
    let kv = numbered(20);
    let read = blocks_of(&kv, "HND", 16, 0, 1);
    let convert = |m: &AgentMetadata| kv_from_ranks(SHAPE, 20, &[(m, &read)]).unwrap_err();
    let mut bf16 = meta("HND", 16, 1);
    bf16.block_lens = vec![bf16.block_lens[0] / 2; SHAPE.layers];
    assert!(convert(&bf16).to_string().contains("dtype"), "{}", convert(&bf16));
    let mut split = meta("HND", 16, 1);
    split.kv_caches_base_addr = vec![4096; 2 * SHAPE.layers];
    assert!(convert(&split).to_string().contains("one per layer"));
    let mut huge = meta("HND", 16, 1);
    huge.block_size = 1 << 20;
    assert!(convert(&huge).to_string().contains("block size"));
    // Four ranks over six heads.
    let m4 = meta("HND", 16, 1);
    let four = vec![(&m4, &read); 4];
    let e = kv_from_ranks(SHAPE, 20, &four).unwrap_err();
    assert!(e.to_string().contains("whole heads"), "{e}");
    // Fewer bytes than the blocks the tokens need.
    let short = Blocks { bytes: read.bytes[..read.bytes.len() - 1].to_vec(), ..read.clone() };
    let ok = meta("HND", 16, 1);
    let e = kv_from_ranks(SHAPE, 20, &[(&ok, &short)]).unwrap_err();
    assert!(matches!(e, VllmError::Invalid(_)), "{e}");
    // Ranks that disagree on the block size.
    let (m0, m1) = (meta("HND", 16, 2), meta("HND", 8, 2));
    let (r0, r1) = (blocks_of(&kv, "HND", 16, 0, 2), blocks_of(&kv, "HND", 8, 1, 2));
    let e = kv_from_ranks(SHAPE, 20, &[(&m0, &r0), (&m1, &r1)]).unwrap_err();
    assert!(e.to_string().contains("rank 1"), "{e}");
    assert!(kv_from_ranks(SHAPE, 20, &[]).is_err());
}
