use super::*;

fn numbered(shape: KvShape, tokens: usize) -> Kv {
    let data = (0..shape.token_bytes() * tokens).map(|i| (i % 251) as u8).collect();
    Kv::from_bytes(shape, tokens, data).unwrap()
}

#[test]
fn slicing_then_concatenating_gives_back_the_same_bytes() {
    let shape = KvShape { layers: 3, kv_heads: 2, head_bytes: 4 };
    let kv = numbered(shape, 10);
    let a = kv.slice_tokens(0..4);
    let b = kv.slice_tokens(4..10);
    assert_eq!(Kv::concat(shape, &[&a, &b]).unwrap(), kv);
}

#[test]
fn from_bytes_rejects_wrong_length() {
    let shape = KvShape { layers: 1, kv_heads: 1, head_bytes: 4 };
    assert!(Kv::from_bytes(shape, 2, vec![0; 15]).is_err());
}

#[test]
fn a_layer_is_its_k_and_v_runs_of_every_head_back_to_back() {
    let shape = KvShape { layers: 3, kv_heads: 2, head_bytes: 4 };
    let kv = numbered(shape, 5);
    for l in 0..3 {
        let mut runs = Vec::new();
        for k in 0..2 {
            for h in 0..2 {
                runs.extend_from_slice(kv.run(l, k, h));
            }
        }
        assert_eq!(kv.layer(l), &runs[..], "layer {l}");
    }
}

#[test]
fn bytes_wrapped_whole_or_by_layer_are_views_not_copies() {
    let shape = KvShape { layers: 3, kv_heads: 2, head_bytes: 4 };
    let data: Vec<u8> = (0..shape.token_bytes() * 5).map(|i| i as u8).collect();
    let at = data.as_ptr();
    let kv = Kv::from_bytes(shape, 5, data.clone()).unwrap();
    let mut kv_at = Vec::new();
    for l in 0..3 {
        assert_eq!(&kv.layer(l)[..], &data[l * 80..(l + 1) * 80], "layer {l}");
        kv_at.push(kv.layer(l).as_ptr());
    }
    let layers: Vec<Bytes> = kv.layers().to_vec();
    let again = Kv::from_layers(shape, 5, layers).unwrap();
    assert_eq!(again, kv);
    for (l, at) in kv_at.into_iter().enumerate() {
        assert_eq!(again.layer(l).as_ptr(), at, "layer {l} copied");
    }
    let moved = Kv::from_bytes(shape, 5, data).unwrap();
    assert_eq!(moved.layer(0).as_ptr(), at, "from_bytes copied");
    let mut m = KvMut::zeroed(shape, 5);
    for l in 0..3 {
        m.layer_mut(l).copy_from_slice(&kv.layer(l)[..]);
    }
    assert_eq!(m.freeze(), kv);
}

#[test]
fn from_layers_rejects_a_wrong_count_or_length() {
    let shape = KvShape { layers: 2, kv_heads: 1, head_bytes: 4 };
    let layer = Bytes::from(vec![0u8; 16]);
    assert!(Kv::from_layers(shape, 2, vec![layer.clone(), layer.clone()]).is_ok());
    assert!(Kv::from_layers(shape, 2, vec![layer.clone()]).is_err(), "one layer short");
    assert!(Kv::from_layers(shape, 2, vec![layer.clone(), layer.slice(..12)]).is_err(), "short");
    assert!(
        Kv::from_layers(shape, 3, vec![layer.clone(), layer]).is_err(),
        "layers short of 3 tokens"
    );
}

#[test]
fn a_run_written_through_kv_mut_is_read_back_by_kv() {
    let shape = KvShape { layers: 2, kv_heads: 3, head_bytes: 4 };
    let mut m = KvMut::zeroed(shape, 5);
    m.run_mut(1, 1, 2).fill(9);
    let kv = m.freeze();
    kv.for_each_run(|l, k, h| {
        let want = if (l, k, h) == (1, 1, 2) { 9 } else { 0 };
        assert!(kv.run(l, k, h).iter().all(|&b| b == want), "run {l} {k} {h}");
    });
}

#[test]
fn gathering_token_ranges_gives_their_slices_back_to_back() {
    let shape = KvShape { layers: 2, kv_heads: 3, head_bytes: 4 };
    let a = numbered(shape, 10);
    let b = Kv::from_bytes(shape, 3, (0..shape.token_bytes() * 3).map(|i| i as u8).collect());
    let b = b.unwrap();
    let got = Kv::gather(shape, &[(&a, 6..9), (&b, 0..3), (&a, 1..2), (&a, 4..4)]).unwrap();
    let mut want = Vec::new();
    a.for_each_run(|l, k, h| {
        want.extend_from_slice(&a.run(l, k, h)[6 * 4..9 * 4]);
        want.extend_from_slice(b.run(l, k, h));
        want.extend_from_slice(&a.run(l, k, h)[4..2 * 4]);
    });
    assert_eq!(got, Kv::from_bytes(shape, 7, want).unwrap());
    assert!(Kv::gather(shape, &[(&a, 8..11)]).is_err(), "past the end");
    let other = KvShape { head_bytes: 8, ..shape };
    assert!(Kv::gather(other, &[(&a, 0..1)]).is_err(), "another shape");
}
