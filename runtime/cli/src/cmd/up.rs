//! `handoff up`: the whole cluster in one process.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use handoff_engine::{Engine, MockConfig, MockEngine};
use handoff_frontend::FrontendConfig;
use handoff_smollm::{SmolConfig, SmolLm};

use crate::args::{EngineArg, EngineArgs, UpArgs};
use crate::stop::Stop;
use crate::{Cluster, ClusterConfig};

/// A source of engine handles: every part of a cluster gets its own (for smollm: shared
/// weights, its own compute thread).
pub type Engines = Box<dyn Fn() -> anyhow::Result<Arc<dyn Engine>>>;

/// The engines the flags ask for.
pub fn engines(args: &EngineArgs) -> anyhow::Result<Engines> {
    Ok(match args.engine {
        EngineArg::Mock => {
            let mock: Arc<dyn Engine> = Arc::new(MockEngine::new(MockConfig {
                prefill_per_token: Duration::from_micros(args.mock_prefill_us),
                decode_per_token: Duration::from_micros(args.mock_decode_us),
                ..MockConfig::default()
            }));
            Box::new(move || Ok(mock.clone()))
        }
        EngineArg::Smollm => {
            let path = args.model_path();
            if !path.exists() {
                bail!(
                    "model not found at {}: run scripts/fetch-model, pass --model PATH, or use --engine mock",
                    path.display()
                );
            }
            let mut cfg = SmolConfig::new(path);
            cfg.max_context = args.max_context;
            let base =
                SmolLm::load(&cfg).with_context(|| format!("loading {}", cfg.path.display()))?;
            Box::new(move || Ok(Arc::new(base.fork()?) as Arc<dyn Engine>))
        }
    })
}

/// Runs until Ctrl-C or SIGTERM.
pub async fn run(args: UpArgs, mut stop: Stop) -> anyhow::Result<()> {
    // No exposure check (`check_exposure`): this process always has a token (given or
    // generated), so its directories, transfers and scheduler are never open, wherever they
    // listen; its public APIs are meant to be reached.
    // Secure by default: the roles in this process authenticate to each other with a token
    // of their own when none is given (processes joining it over etcd/NATS need --token).
    let generated = args.discovery.token.is_none();
    let token = args.discovery.token.clone().unwrap_or_else(crate::cmd::generated_token);
    let cfg = ClusterConfig {
        prefills: args.prefills,
        schedulers: usize::from(args.schedulers),
        scheduler_in_frontend: args.scheduler_in_frontend,
        prefill_dp: args.prefill_dp,
        prefill_tp: args.prefill_tp,
        decode_tp: args.decode_tp,
        transfer: args.discovery.transfer()?,
        frontend_bind: args.frontend_listen,
        http_bind: args.http_listen,
        scheduler_bind: args.scheduler_listen,
        bootstrap_port: args.bootstrap_port,
        prefill_port: args.prefill_port,
        token: Some(token),
        tls: args.discovery.cluster_tls()?,
        frontend: FrontendConfig {
            public_tls: args.public_tls.server_tls()?,
            request_timeout: args.requests.request_timeout(),
            max_decoding: args.requests.max_decoding(),
            http: args.requests.http(),
            inbox: args.requests.inbox(),
            ..FrontendConfig::default()
        },
        scheduler: args.policy.config(),
        ..ClusterConfig::default()
    };
    let engines = engines(&args.engine)?;
    let tasks = handoff_core::Tasks::new();
    let starting = async {
        let (registry, bus) = crate::cmd::discovery(&args.discovery, &tasks).await?;
        Cluster::start_with(cfg, &*engines, registry, bus, tasks.clone()).await
    };
    let Some(cluster) = stop.starting(&tasks, starting).await? else {
        return Ok(());
    };
    args.discovery.watch_tls(Some(&args.public_tls), &tasks);
    let mut out = std::io::stdout().lock();
    // "s" where a listener speaks TLS.
    let inner = if args.discovery.tls_cert.is_some() { "s" } else { "" };
    let public = if args.public_tls.public_tls_cert.is_some() { "s" } else { "" };
    for s in &cluster.schedulers {
        writeln!(out, "scheduler  grpc{inner}://{} (replica {})", s.addr, s.scheduler.replica())?;
    }
    for p in &cluster.prefills {
        writeln!(
            out,
            "prefill    {} bootstrap http{inner}://{} grpc{inner}://{}",
            p.id, p.bootstrap_addr, p.grpc_addr
        )?;
    }
    let asks = if args.scheduler_in_frontend { ", scheduler in its process" } else { "" };
    writeln!(
        out,
        "frontend   grpc{public}://{} (handoff.v1.Generate)  http{public}://{} (OpenAI API){asks}",
        cluster.frontend_addr, cluster.http_addr
    )?;
    let model = cluster.frontend.model_name().to_owned();
    writeln!(
        out,
        "handoff ready: model {model}, {} prefill instances, transfer {:?}, cluster token {}",
        cluster.prefills.len(),
        args.discovery.transfer,
        if generated { "generated (pass --token to set one)" } else { "given" }
    )?;
    writeln!(
        out,
        "try: curl -s http{public}://{}/v1/chat/completions -H 'content-type: application/json' -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}]}}'",
        cluster.http_addr
    )?;
    out.flush()?;
    drop(out);
    stop.wait().await;
    cluster.shutdown().await;
    Ok(())
}
