use super::*;
use crate::worker::tests::model_path;

/// The real model file, its header read: its contents, the file, its shapes.
fn opened() -> (gguf_file::Content, BufReader<File>, Hyper) {
    let mut file = BufReader::new(File::open(model_path()).unwrap());
    let content = gguf_file::Content::read(&mut file).unwrap();
    let hp = hyper(&content, 512).unwrap();
    (content, file, hp)
}

/// The stacked projections give each of their matrices' outputs exactly (the rows of one
/// after the other's), on the real model's first and last layers.
#[test]
fn stacked_matrices_answer_as_each_alone() {
    let (content, file, hp) = opened();
    let mut r = Reader { content: &content, file };
    let rows = 3;
    // Inputs of a norm's scale, varied per row and column.
    let x: Vec<f32> =
        (0..rows * hp.dim).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 1.7).collect();
    let kv = hp.kv_dim();
    let shapes = [
        (&["attn_q", "attn_k", "attn_v"][..], vec![hp.dim, kv, kv]),
        (&["ffn_gate", "ffn_up"], vec![hp.ffn; 2]),
    ];
    for layer in [0, hp.layers - 1] {
        for (parts, part_rows) in &shapes {
            let names: Vec<String> =
                parts.iter().map(|p| format!("blk.{layer}.{p}.weight")).collect();
            let alone: Vec<Vec<f32>> =
                names.iter().map(|n| r.matrix(n).unwrap().apply(&x, rows).unwrap()).collect();
            let stacked = r.stacked(&names, part_rows).unwrap().apply(&x, rows).unwrap();
            let width: usize = alone.iter().map(|a| a.len() / rows).sum();
            for row in 0..rows {
                let mut at = row * width;
                for a in &alone {
                    let w = a.len() / rows;
                    assert_eq!(&stacked[at..at + w], &a[row * w..(row + 1) * w], "{names:?}");
                    at += w;
                }
            }
        }
    }
}

/// A file whose projections are not the shapes its header gives is refused by name, not
/// split wrongly.
#[test]
fn matrices_of_other_shapes_than_the_header_are_refused() {
    let (content, file, hp) = opened();
    let mut r = Reader { content: &content, file };
    let kv = hp.kv_dim();
    let names: Vec<String> =
        ["attn_q", "attn_k", "attn_v"].iter().map(|p| format!("blk.0.{p}.weight")).collect();
    let Err(e) = r.stacked(&names, &[hp.dim, kv + 64, kv]) else { panic!("accepted") };
    assert!(e.to_string().contains("blk.0.attn_k.weight"), "{e}");
}
