//! Imported KV is read in place, and a sequence's layers come out as imported then computed.

use handoff_engine::{Kv, KvMut};

use super::{Seq, token_rows};
use crate::weights::Hyper;

fn hyper() -> Hyper {
    Hyper {
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        dim: 16,
        ffn: 32,
        vocab: 10,
        context: 16,
        eps: 1e-5,
        rope_base: 10_000.0,
    }
}

/// A value of its own for each (layer, k|v, head, token, element).
fn value(l: usize, kind: usize, h: usize, t: usize, e: usize) -> f32 {
    (l * 10_000 + kind * 1_000 + h * 100 + t * 10 + e) as f32
}

/// `tokens` tokens of KV, each float [`value`], in the canonical layout.
fn kv(hp: &Hyper, tokens: usize) -> Kv {
    let mut kv = KvMut::zeroed(Seq::shape(hp), tokens);
    for l in 0..hp.layers {
        for kind in 0..2 {
            for h in 0..hp.kv_heads {
                let floats: Vec<f32> = (0..tokens)
                    .flat_map(|t| (0..hp.head_dim).map(move |e| value(l, kind, h, t, e)))
                    .collect();
                kv.run_mut(l, kind, h).copy_from_slice(bytemuck::cast_slice(&floats));
            }
        }
    }
    kv.freeze()
}

#[test]
fn imported_kv_is_read_where_it_arrived() {
    let hp = hyper();
    let seq = Seq::from_kv(&hp, kv(&hp, 3)).expect("the model's shape");
    assert_eq!(seq.len, 3);
    let base = seq.base.as_ref().expect("imported as a view");
    for l in 0..hp.layers {
        for h in 0..hp.kv_heads {
            let [keys, values] = seq.runs(l, h, hp.kv_heads);
            // The very bytes imported, not a copy of them.
            assert_eq!(keys.0.as_ptr().cast::<u8>(), base.run(l, 0, h).as_ptr());
            assert_eq!(values.0.as_ptr().cast::<u8>(), base.run(l, 1, h).as_ptr());
            assert!(keys.1.is_empty() && values.1.is_empty(), "nothing computed yet");
        }
    }
}

#[test]
fn layers_come_out_imported_then_computed() {
    let hp = hyper();
    let mut seq = Seq::from_kv(&hp, kv(&hp, 3)).expect("the model's shape");
    // One token computed here (token 3), as the forward pass appends it.
    for l in 0..hp.layers {
        for h in 0..hp.kv_heads {
            let c = l * hp.kv_heads + h;
            seq.k[c].extend((0..hp.head_dim).map(|e| value(l, 0, h, 3, e)));
            seq.v[c].extend((0..hp.head_dim).map(|e| value(l, 1, h, 3, e)));
        }
    }
    // Mid-pass, `len` still counts the imported tokens: the layer is sized by its runs, in
    // one allocation (std allocates what `with_capacity` asks; a buffer grown on the way
    // would have more).
    let mid = seq.layer_kv(&hp, 0);
    assert_eq!((mid.len(), mid.capacity()), (Seq::shape(&hp).layer_bytes(4), mid.len()));
    seq.len = 4;
    let whole = kv(&hp, 4);
    let mut out = KvMut::zeroed(Seq::shape(&hp), 4);
    for l in 0..hp.layers {
        out.layer_mut(l).copy_from_slice(&seq.layer_kv(&hp, l));
        let [keys, _] = seq.runs(l, 1, hp.kv_heads);
        let rows: Vec<f32> = token_rows(keys, hp.head_dim).map(|r| r[0]).collect();
        assert_eq!(rows, (0..4).map(|t| value(l, 0, 1, t, 0)).collect::<Vec<_>>());
    }
    assert_eq!(out.freeze(), whole);
}

/// An import of no tokens (whichever path its empty buffers take) is an empty sequence, not
/// a panic.
#[test]
fn an_empty_import_is_an_empty_sequence() {
    let hp = hyper();
    let seq = Seq::from_kv(&hp, kv(&hp, 0)).expect("the model's shape");
    assert_eq!(seq.len, 0);
    let mut out = KvMut::zeroed(Seq::shape(&hp), 0);
    for l in 0..hp.layers {
        out.layer_mut(l).copy_from_slice(&seq.layer_kv(&hp, l));
        let [keys, values] = seq.runs(l, 0, hp.kv_heads);
        assert_eq!(token_rows(keys, hp.head_dim).chain(token_rows(values, hp.head_dim)).count(), 0);
    }
}
