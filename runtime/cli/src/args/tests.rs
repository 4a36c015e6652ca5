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

fn frontend(args: &[&str]) -> Result<FrontendArgs, clap::Error> {
    let argv = ["handoff", "frontend"].iter().chain(args).copied();
    match Cli::try_parse_from(argv)?.command {
        Command::Frontend(a) => Ok(a),
        other => panic!("parsed as {other:?}"),
    }
}

#[test]
fn a_frontend_runs_its_own_scheduler_only_when_asked_and_then_takes_the_selection_flags() {
    let a = frontend(&[]).unwrap();
    assert!(!a.scheduler_in_frontend);
    let a = frontend(&["--scheduler-in-frontend", "--policy", "round-robin"]).unwrap();
    assert!(a.scheduler_in_frontend);
    assert_eq!(a.policy.config().default_policy, PolicyKind::RoundRobin);
    for bad in [
        &["--scheduler-in-frontend", "--scheduler", "127.0.0.1:1"][..],
        &["--scheduler-ops-listen", "127.0.0.1:0"],
    ] {
        let e = frontend(bad).unwrap_err().to_string();
        assert!(e.contains("--scheduler"), "{bad:?}: {e}");
    }
}
