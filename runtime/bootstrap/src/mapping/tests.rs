use super::*;

fn par(tp: usize, pp: usize) -> Parallel {
    Parallel { tp, pp, cp: 1 }
}

/// p_tp, d_tp, d_rank, p_pp, d_pp, d_pp_rank -> tp ranks, pp ranks, peers, responses.
type GoldenRow = (usize, usize, usize, usize, usize, usize, Vec<usize>, Vec<usize>, usize, usize);

#[test]
fn golden_rank_rows_match_sglang() {
    // p_tp d_tp d_rank pp(p/d) -> tp ranks, pp ranks, peers, responses
    let rows: [GoldenRow; 5] = [
        (4, 4, 1, 1, 1, 0, vec![1], vec![0], 1, 1),
        (2, 8, 5, 1, 1, 0, vec![1], vec![0], 4, 1),
        (8, 2, 1, 1, 1, 0, vec![4, 5, 6, 7], vec![0], 1, 4),
        (4, 4, 2, 2, 1, 0, vec![2], vec![0, 1], 1, 2),
        (4, 4, 2, 2, 2, 1, vec![2], vec![1], 1, 1),
    ];
    for (p, d, r, ppp, dpp, dppr, tp, pp, peers, resp) in rows {
        let plan = plan_ranks(par(p, ppp), par(d, dpp), r, dppr, false).unwrap();
        assert_eq!(plan.tp_ranks, tp, "row {p} {d} {r}");
        assert_eq!(plan.pp_ranks, pp);
        assert_eq!((plan.peers, plan.responses), (peers, resp));
        assert_eq!(plan.cp_ranks, vec![0]);
    }
}

#[test]
fn golden_head_slices_match_sglang() {
    let rows = [
        ((2, 8, 1, 5, 8), (1, 1, 0)),
        ((8, 2, 5, 1, 8), (0, 1, 1)),
        ((4, 2, 3, 1, 8), (0, 2, 2)),
        ((8, 2, 5, 1, 4), (0, 1, 0)),
    ];
    for ((p, d, s, t, h), (a, n, b)) in rows {
        assert_eq!(
            head_slice(p, d, s, t, h),
            HeadSlice { src_start: a, count: n, dst_start: b },
            "{p} {d} {s} {t} {h}"
        );
    }
}

#[test]
fn head_slices_move_each_decode_head_from_a_prefill_rank_that_holds_it() {
    for (p, d, h) in [(2, 1, 4), (2, 4, 4), (1, 2, 4), (4, 4, 4), (2, 8, 8), (8, 2, 4), (3, 1, 3)] {
        for dst in 0..d {
            let plan = plan_ranks(par(p, 1), par(d, 1), dst, 0, false).unwrap();
            let mut covered = vec![];
            for &src in &plan.tp_ranks {
                let s = head_slice(p, d, src, dst, h);
                let src_heads = rank_heads(p, h, src);
                let dst_heads = rank_heads(d, h, dst);
                for i in 0..s.count {
                    let global = src_heads.start + s.src_start + i;
                    assert_eq!(global, dst_heads.start + s.dst_start + i, "{p} {d} {src}->{dst}");
                    covered.push(s.dst_start + i);
                }
            }
            covered.sort();
            covered.dedup();
            assert_eq!(covered, (0..heads_per_rank(d, h)).collect::<Vec<_>>());
        }
    }
}

#[test]
fn unsupported_topologies_are_errors_not_panics() {
    assert!(plan_ranks(par(3, 1), par(2, 1), 0, 0, false).is_err());
    assert!(plan_ranks(par(2, 1), par(2, 1), 2, 0, false).is_err());
    assert!(plan_ranks(par(2, 2), par(2, 4), 0, 0, false).is_err());
    assert!(plan_ranks(par(0, 1), par(2, 1), 0, 0, false).is_err());
}

#[test]
fn pp_layers_cover_every_layer_once() {
    let all: Vec<usize> = (0..3).flat_map(|q| pp_layers(30, 3, q)).collect();
    assert_eq!(all, (0..30).collect::<Vec<_>>());
}

#[test]
fn readers_per_sender_counts_the_decode_ranks_whose_plan_names_each_prefill_rank() {
    for (p, d) in [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4), (4, 2), (8, 1), (1, 8), (2, 8), (8, 2)] {
        let plans: Vec<_> =
            (0..d).map(|dst| plan_ranks(par(p, 1), par(d, 1), dst, 0, false).unwrap()).collect();
        for src in 0..p {
            let readers = plans.iter().filter(|plan| plan.tp_ranks.contains(&src)).count();
            assert!(plans.iter().all(|plan| plan.peers == readers), "the plan's own count");
            assert_eq!(readers_per_sender(d, p), readers, "prefill tp {p}, decode tp {d}");
        }
    }
}
