//! Golden payloads recorded from vLLM's and SGLang's own code (`../shared/interop/kv-events.md`
//! §1; SGLang 0.5.23's `KVEventBatch` through its publisher's `msgspec` encoder), and
//! hand-built ones for vLLM's bytes hashes.

use rmpv::Value;

use super::*;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// vLLM 0.33: one BlockStored of 2 blocks, block size 4, tokens 100..107, map encoding.
const VLLM_033: &str = "93cb41dac3723315a6bf91de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf1cccfba573d0cf8acff20358aa4fbb8879b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473986465666768696a6baa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780000";

/// vLLM 0.22: BlockStored, BlockRemoved and AllBlocksCleared, array encoding, ts 1.5.
const VLLM_022: &str = "93cb3ff8000000000000939cab426c6f636b53746f726564920102c092050601c0a3475055c0c0c0c0c094ac426c6f636b52656d6f7665649102c0c091b0416c6c426c6f636b73436c6561726564c0";

/// SGLang 0.5.23: BlockStored (signed hashes -7, -8, parent -6, tokens 11 and 12, block size
/// 1), BlockRemoved (-8) and AllBlocksCleared, dp rank 1, ts 2.5: map-tagged events, as its
/// `ZmqEventPublisher` encodes them.
const SGLANG_0523: &str = "93cb40040000000000009387a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392f9f8b1706172656e745f626c6f636b5f68617368faa9746f6b656e5f696473920b0caa626c6f636b5f73697a6501a76c6f72615f6964c0a66d656469756da347505583a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391f8a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656401";

#[test]
fn sglang_0523_events_with_signed_hashes() {
    let b = decode_batch(&hex(SGLANG_0523)).unwrap();
    assert_eq!((b.ts, b.dp_rank), (2.5, Some(1)));
    assert_eq!(b.events.len(), 3);
    let signed = |h: i64| h as u64;
    assert!(
        matches!(
            &b.events[0],
            Event::Stored { hashes, parent: Some(p), token_ids, block_size: 1, lora_name: None, .. }
                if hashes == &[signed(-7), signed(-8)] && *p == signed(-6) && token_ids == &[11, 12]
        ),
        "{:?}",
        b.events[0]
    );
    assert_eq!(
        b.events[1],
        Event::Removed { hashes: vec![signed(-8)], medium: Some("GPU".into()), group_idx: None }
    );
    assert_eq!(b.events[2], Event::Cleared);
}

#[test]
fn vllm_033_map_events() {
    let b = decode_batch(&hex(VLLM_033)).unwrap();
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(
        b.events,
        vec![Event::Stored {
            hashes: vec![0x1ccc_fba5_73d0_cf8a, 0xf203_58aa_4fbb_8879],
            parent: None,
            token_ids: (100..108).collect(),
            block_size: 4,
            lora_name: None,
            namespaced: false,
            spec_kind: None,
            medium: Some("GPU".into()),
            extra_keys: false,
            group_idx: Some(0),
            bigram: false,
        }]
    );
}

#[test]
fn vllm_022_array_events() {
    let b = decode_batch(&hex(VLLM_022)).unwrap();
    assert_eq!((b.ts, b.dp_rank), (1.5, None));
    assert_eq!(b.events.len(), 3);
    assert!(matches!(
        &b.events[0],
        Event::Stored { hashes, parent: None, token_ids, block_size: 1, medium: Some(m), .. }
            if hashes == &[1, 2] && token_ids == &[5, 6] && m == "GPU"
    ));
    assert_eq!(b.events[1], Event::Removed { hashes: vec![2], medium: None, group_idx: None });
    assert_eq!(b.events[2], Event::Cleared);
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn map(fields: Vec<(&str, Value)>) -> Value {
    Value::Map(fields.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
}

#[test]
fn signed_and_bytes_hashes_bigrams_and_unknown_fields() {
    let stored = map(vec![
        ("type", "BlockStored".into()),
        ("block_hashes", Value::Array(vec![Value::from(-5i64), Value::Binary(vec![9; 32])])),
        ("parent_block_hash", Value::from(-1i64)),
        (
            "token_ids",
            Value::Array(vec![
                Value::Array(vec![7.into(), 8.into()]),
                Value::Array(vec![8.into(), 9.into()]),
            ]),
        ),
        ("block_size", 1.into()),
        ("something_new", "ignored".into()),
        ("lora_name", "adapter".into()),
    ]);
    let batch = Value::Array(vec![
        2.0.into(),
        Value::Array(vec![stored, map(vec![("type", "Future".into())])]),
    ]);
    let b = decode_batch(&encode(&batch)).unwrap();
    let Event::Stored { hashes, parent, token_ids, bigram, lora_name, .. } = &b.events[0] else {
        panic!("{:?}", b.events[0]);
    };
    assert_eq!(hashes, &[(-5i64) as u64, 0x0909_0909_0909_0909]);
    assert_eq!(*parent, Some(u64::MAX));
    assert_eq!((token_ids.as_slice(), *bigram), (&[7, 8][..], true));
    assert_eq!(lora_name.as_deref(), Some("adapter"));
    assert_eq!(b.events[1], Event::Unknown("Future".into()));
}

/// A LoRA named by id only (old vLLM and SGLang), a cache salt (SGLang), the kind of cache,
/// and the group of a removal are all read, whichever encoding.
#[test]
fn namespaces_cache_kinds_and_removal_groups() {
    let stored = |extra: Vec<(&str, Value)>| {
        let mut fields = vec![
            ("type", "BlockStored".into()),
            ("block_hashes", Value::Array(vec![1.into()])),
            ("parent_block_hash", Value::Nil),
            ("token_ids", Value::Array(vec![5.into()])),
            ("block_size", 1.into()),
        ];
        fields.extend(extra);
        map(fields)
    };
    let removed = map(vec![
        ("type", "BlockRemoved".into()),
        ("block_hashes", Value::Array(vec![1.into()])),
        ("group_idx", 1.into()),
    ]);
    // vLLM 0.9's array: hashes, parent, tokens, block size, lora id.
    let array = Value::Array(vec![
        "BlockStored".into(),
        Value::Array(vec![2.into()]),
        Value::Nil,
        Value::Array(vec![6.into()]),
        1.into(),
        7.into(),
    ]);
    // vLLM 0.22's array: every field, the kind of cache eleventh.
    let windowed = Value::Array(vec![
        "BlockStored".into(),
        Value::Array(vec![3.into()]),
        Value::Nil,
        Value::Array(vec![7.into()]),
        1.into(),
        Value::Nil,
        "GPU".into(),
        Value::Nil,
        Value::Nil,
        0.into(),
        "sliding_window".into(),
        Value::from(128),
    ]);
    let events = vec![
        stored(vec![("lora_id", Value::Nil), ("cache_salt", Value::Nil)]),
        stored(vec![("lora_id", 7.into())]),
        stored(vec![("cache_salt", "tenant-a".into())]),
        stored(vec![("kv_cache_spec_kind", "sliding_window".into())]),
        array,
        removed,
        windowed,
    ];
    let b = decode_batch(&encode(&Value::Array(vec![1.0.into(), Value::Array(events)]))).unwrap();
    let read = |e: &Event| match e {
        Event::Stored { namespaced, spec_kind, .. } => (*namespaced, spec_kind.clone()),
        other => panic!("{other:?}"),
    };
    assert_eq!(read(&b.events[0]), (false, None));
    assert_eq!(read(&b.events[1]), (true, None));
    assert_eq!(read(&b.events[2]), (true, None));
    assert_eq!(read(&b.events[3]), (false, Some("sliding_window".into())));
    assert_eq!(read(&b.events[4]), (true, None));
    assert_eq!(b.events[5], Event::Removed { hashes: vec![1], medium: None, group_idx: Some(1) });
    assert_eq!(read(&b.events[6]), (false, Some("sliding_window".into())));
}

#[test]
fn malformed_payloads_are_refused_not_panicked_on() {
    for bad in [
        vec![],
        vec![0xc1],
        hex("93cb3ff8"),
        encode(&Value::from("batch")),
        encode(&Value::Array(vec![1.0.into(), 5.into()])),
        encode(&Value::Array(vec![
            1.0.into(),
            Value::Array(vec![map(vec![("block_size", 1.into())])]),
        ])),
        encode(&Value::Array(vec![
            1.0.into(),
            Value::Array(vec![map(vec![
                ("type", "BlockStored".into()),
                ("block_hashes", Value::Array(vec![])),
            ])]),
        ])),
        // A 2^32-element array declared in 5 bytes: refused without allocating it.
        hex("93cb3ff8000000000000dd7fffffff"),
    ] {
        assert!(decode_batch(&bad).is_err(), "{bad:02x?}");
    }
    // Every prefix of a good payload: an error or a batch, never a panic.
    let good = hex(VLLM_033);
    for n in 0..good.len() {
        let _ = decode_batch(&good[..n]);
    }
}
