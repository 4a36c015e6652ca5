use super::*;
use crate::worker::tests::model_path;

/// The stacked projections give each of their matrices' outputs exactly (the rows of one
/// after the other's), on the real model's first and last layers.
#[test]
fn stacked_matrices_answer_as_each_alone() {
    let mut file = BufReader::new(File::open(model_path()).unwrap());
    let content = gguf_file::Content::read(&mut file).unwrap();
    let hp = hyper(&content, 512).unwrap();
    let mut r = Reader { content: &content, file };
    let rows = 3;
    // Inputs of a norm's scale, varied per row and column.
    let x: Vec<f32> =
        (0..rows * hp.dim).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 1.7).collect();
    for layer in [0, hp.layers - 1] {
        for parts in [&["attn_q", "attn_k", "attn_v"][..], &["ffn_gate", "ffn_up"]] {
            let names: Vec<String> =
                parts.iter().map(|p| format!("blk.{layer}.{p}.weight")).collect();
            let alone: Vec<Vec<f32>> =
                names.iter().map(|n| r.matrix(n).unwrap().apply(&x, rows).unwrap()).collect();
            let stacked = r.stacked(&names).unwrap().apply(&x, rows).unwrap();
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
