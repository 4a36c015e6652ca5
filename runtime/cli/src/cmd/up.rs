//! `handoff up`: the whole cluster in one process.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use handoff_engine::{Engine, MockConfig, MockEngine};
use handoff_transfer::{FakeNetwork, TransferKind};

use crate::args::{EngineArg, MockArgs, TransferArg, UpArgs};
use crate::{Cluster, ClusterConfig};

/// The engine the flags ask for.
pub fn engine(kind: EngineArg, mock: &MockArgs) -> Arc<dyn Engine> {
    match kind {
        EngineArg::Mock => Arc::new(MockEngine::new(MockConfig {
            prefill_per_token: Duration::from_micros(mock.mock_prefill_us),
            decode_per_token: Duration::from_micros(mock.mock_decode_us),
            ..MockConfig::default()
        })),
    }
}

/// The transfer backend the flags ask for.
pub fn transfer(kind: TransferArg) -> TransferKind {
    match kind {
        TransferArg::Tcp => TransferKind::loopback(),
        TransferArg::Fake => TransferKind::Fake(FakeNetwork::new()),
    }
}

/// Runs until Ctrl-C or SIGTERM.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    if args.model.is_some() {
        bail!("--model needs a real engine; this build serves --engine mock");
    }
    let cfg = ClusterConfig {
        prefills: args.prefills,
        prefill_dp: args.prefill_dp,
        prefill_tp: args.prefill_tp,
        decode_tp: args.decode_tp,
        transfer: transfer(args.transfer),
        frontend_bind: args.frontend_listen,
        scheduler_bind: args.scheduler_listen,
        bootstrap_port: args.bootstrap_port,
        prefill_port: args.prefill_port,
        ..ClusterConfig::default()
    };
    let cluster = Cluster::start(cfg, engine(args.engine, &args.mock)).await?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "scheduler  grpc://{}", cluster.scheduler_addr)?;
    for p in &cluster.prefills {
        writeln!(
            out,
            "prefill    {} bootstrap http://{} grpc://{}",
            p.id, p.bootstrap_addr, p.grpc_addr
        )?;
    }
    writeln!(out, "frontend   grpc://{} (handoff.v1.Generate)", cluster.frontend_addr)?;
    writeln!(
        out,
        "handoff ready: {} prefill instances, transfer {:?}",
        cluster.prefills.len(),
        args.transfer
    )?;
    out.flush()?;
    drop(out);
    shutdown_signal().await;
    cluster.shutdown().await;
    Ok(())
}

/// Completes on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
