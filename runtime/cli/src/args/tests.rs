use clap::Parser;

use super::*;

fn scheduler(args: &[&str]) -> Result<SchedulerArgs, clap::Error> {
    let argv = ["handoff", "scheduler"].iter().chain(args).copied();
    match Cli::try_parse_from(argv)?.command {
        Command::Scheduler(a) => Ok(a),
        other => panic!("parsed as {other:?}"),
    }
}

#[test]
fn policy_flags_set_the_scheduler_config() {
    let cfg = scheduler(&[]).unwrap().policy.config();
    assert_eq!(cfg.default_policy, PolicyKind::KvAware);
    assert_eq!(cfg.params, PolicyParams::default(), "flag defaults are the code's defaults");
    let a = scheduler(&["--policy", "prefix-hash", "--kv-load-weight", "0.5"]).unwrap();
    let cfg = a.policy.config();
    assert_eq!(cfg.default_policy, PolicyKind::PrefixHash);
    assert_eq!(cfg.params.kv_aware.load, 0.5);
}

#[test]
fn bad_policy_flags_are_clear_errors() {
    for bad in [
        &["--policy", "fastest"][..],
        &["--kv-load-weight", "-1"],
        &["--kv-load-weight", "NaN"],
        &["--kv-temperature", "inf"],
        &["--prefix-load-factor", "x"],
    ] {
        let e = scheduler(bad).unwrap_err().to_string();
        assert!(e.contains(bad[0]) || e.contains(bad[1]), "{bad:?}: {e}");
    }
}
