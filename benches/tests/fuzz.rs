//! The short version of `cargo run -p handoff-benches --bin fuzz`: every decoder of network
//! bytes, 20k inputs each, several seeds, no panic and no 5xx.

use handoff_benches::fuzz;

#[tokio::test]
async fn no_decoder_panics_on_mutated_or_random_input() {
    for seed in [1, 2] {
        for r in [
            fuzz::transfer_frames(20_000, seed).await,
            fuzz::bootstrap_http(5_000, seed).await,
            fuzz::bus_payloads(20_000, seed),
        ] {
            assert_eq!(r.failed, 0, "{} (seed {seed}): {:?}", r.name, r.failures);
            assert!(r.inputs > 0);
        }
    }
}
