use std::process::Command;

use super::*;

/// Where the test, run again as its own probe, is told the delays to expect: before and after
/// [`keep_freed_memory`], as `BEFORE,AFTER`.
const EXPECT_VAR: &str = "HANDOFF_TEST_PURGE_DELAYS";

/// This test's name, for running it again as a probe.
const THIS_TEST: &str = "alloc::tests::the_purge_delay_is_a_minute_unless_the_environment_sets_it";

/// Runs this test again as a probe, in a process of its own (mimalloc reads its environment
/// as a process starts), with no `MIMALLOC_*` variable but `env`; whether it passed.
fn probe(env: &[(&str, &str)], expect: &str) -> bool {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", THIS_TEST]);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().to_ascii_uppercase().starts_with("MIMALLOC_") {
            cmd.env_remove(name);
        }
    }
    let out = cmd.envs(env.iter().copied()).env(EXPECT_VAR, expect).output().unwrap();
    // A filter that matched no test passes too: the probe must have run.
    out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed")
}

/// The probe: the delays before and after [`keep_freed_memory`] are `expect`'s.
fn check_delays(expect: &str) {
    let (before, after) = expect.split_once(',').unwrap();
    assert_eq!(purge_delay_now_ms().to_string(), before, "before");
    keep_freed_memory();
    assert_eq!(purge_delay_now_ms().to_string(), after, "after");
    keep_freed_memory();
    assert_eq!(purge_delay_now_ms().to_string(), after, "again");
}

#[test]
fn the_purge_delay_is_a_minute_unless_the_environment_sets_it() {
    if let Ok(expect) = std::env::var(EXPECT_VAR) {
        return check_delays(&expect);
    }
    // mimalloc 3's default is 1000 ms, which no other of its options has: the index is the
    // purge delay's.
    assert!(probe(&[], "1000,60000"), "a minute, from mimalloc's default of a second");
    assert!(probe(&[("MIMALLOC_PURGE_DELAY", "5")], "5,5"), "the environment's delay is kept");
    assert!(probe(&[("mimalloc_purge_delay", "-1")], "-1,-1"), "in any case");
    assert!(probe(&[("MIMALLOC_PURGE_DELAY", "60s")], "1000,60000"), "an invalid one is not");
}
