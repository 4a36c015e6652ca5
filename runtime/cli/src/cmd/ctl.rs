//! `handoff ctl`: asks a running cluster what it believes. Scheduler replicas are found in
//! etcd (or named with `--scheduler`); output is for people, or JSON with `--json`.

use std::time::Duration;

mod http;

use anyhow::{Context, bail};
use futures::StreamExt;
use handoff_bootstrap::DirectoryClient;
use handoff_core::Tasks;
use handoff_discovery::{Instance, Role, Update};
use handoff_proto::auth;
use handoff_proto::grpc::cluster_channel;
use handoff_proto::v1::prefill_client::PrefillClient;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{DrainRequest, InstanceStatus, ListInstancesRequest};
use serde_json::{Value, json};

use crate::args::{CtlArgs, CtlCommand};

/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs one `ctl` command and prints its answer on stdout.
pub async fn run(args: CtlArgs) -> anyhow::Result<()> {
    let tasks = Tasks::new();
    let out = answer(&args, &tasks).await;
    tasks.shutdown().await;
    crate::cmd::announce(&out?)?;
    Ok(())
}

/// The command's answer, as printed.
pub async fn answer(args: &CtlArgs, tasks: &Tasks) -> anyhow::Result<String> {
    let ctl = Ctl::new(args, tasks).await?;
    match &args.command {
        CtlCommand::Instances => {
            let (replica, list) = ctl.instances().await?;
            let mut registered = ctl.registered(Role::Scheduler).await?;
            registered.extend(ctl.registered(Role::Frontend).await?);
            // Engines appear in the scheduler's list; registered but not followed ones here.
            let listed: Vec<&str> = list.iter().map(|i| i.instance_id.as_str()).collect();
            let engines = ctl.registered(Role::Engine).await?;
            registered.extend(engines.into_iter().filter(|e| !listed.contains(&e.id.as_str())));
            Ok(if args.json {
                instances_json(&replica, &list, &registered).to_string()
            } else {
                instances_table(&replica, &list, &registered)
            })
        }
        CtlCommand::Directory { id } => {
            let (_, list) = ctl.instances().await?;
            let Some(i) = list.iter().find(|i| &i.instance_id == id) else {
                bail!("no instance {id} known to the scheduler");
            };
            let table = ctl.directory(&i.bootstrap_addr).await?;
            Ok(if args.json { table.to_string() } else { directory_text(id, &table) })
        }
        CtlCommand::Drain { id, grace_secs } => {
            let (_, list) = ctl.instances().await?;
            let Some(i) = list.iter().find(|i| &i.instance_id == id) else {
                bail!("no instance {id} known to the scheduler");
            };
            let left = ctl.drain(&i.prefill_addr, *grace_secs).await?;
            Ok(if args.json {
                json!({"id": id, "drained": left == 0, "left": left}).to_string()
            } else if left == 0 {
                format!("{id}: out of routing, nothing in flight; stop it when you like")
            } else {
                format!(
                    "{id}: out of routing; {left} requests still in flight after {grace_secs} s"
                )
            })
        }
        CtlCommand::Trace { room, frontend } => {
            let frontends = match frontend.is_empty() {
                false => frontend.clone(),
                true => ctl
                    .registered(Role::Frontend)
                    .await?
                    .into_iter()
                    .map(|i| i.bootstrap_addr)
                    .collect(),
            };
            let (at, trace) = ctl.trace(*room, &frontends).await?;
            Ok(if args.json { trace.to_string() } else { trace_text(*room, &at, &trace) })
        }
    }
}

struct Ctl<'a> {
    args: &'a CtlArgs,
    tls: Option<handoff_core::tls::ClusterTls>,
    /// A client of the frontends' public certificate (`--public-ca`).
    public: Option<http::PublicTls>,
    registry: Option<std::sync::Arc<dyn handoff_discovery::Registry>>,
}

impl<'a> Ctl<'a> {
    async fn new(args: &'a CtlArgs, tasks: &Tasks) -> anyhow::Result<Ctl<'a>> {
        let tls = args.discovery.cluster_tls()?;
        let public = http::PublicTls::from_args(args)?;
        let registry = match &args.discovery.etcd {
            // A process waits for an etcd not up yet; a command does not.
            Some(etcd) => {
                let found = crate::cmd::discovery(&args.discovery, tasks);
                match tokio::time::timeout(std::time::Duration::from_secs(10), found).await {
                    Ok(found) => Some(found?.0),
                    Err(_) => bail!("etcd at {etcd} not reached within 10 s"),
                }
            }
            None if args.scheduler.is_some() => None,
            None => bail!("give --scheduler HOST:PORT, or --etcd and --nats to find the replicas"),
        };
        Ok(Ctl { args, tls, public, registry })
    }

    /// The instances registered in etcd with `role` (none without etcd).
    async fn registered(&self, role: Role) -> anyhow::Result<Vec<Instance>> {
        let Some(reg) = &self.registry else { return Ok(Vec::new()) };
        let mut updates = reg.watch(role).await?;
        match tokio::time::timeout(CALL_TIMEOUT, updates.next()).await {
            Ok(Some(Update::Reset(all))) => Ok(all),
            Ok(_) => bail!("the registry's watch did not start with the full set"),
            Err(_) => bail!("etcd did not answer within {CALL_TIMEOUT:?}"),
        }
    }

    /// The instances as the first scheduler replica that answers sees them.
    async fn instances(&self) -> anyhow::Result<(String, Vec<InstanceStatus>)> {
        let replicas = match &self.args.scheduler {
            Some(a) => vec![a.clone()],
            None => {
                self.registered(Role::Scheduler).await?.into_iter().map(|i| i.grpc_addr).collect()
            }
        };
        if replicas.is_empty() {
            bail!(
                "no scheduler replica registered (one running inside a frontend, --scheduler-in-frontend, is not: pass --scheduler with the frontend's --scheduler-listen address, or start a `handoff scheduler` beside it)"
            );
        }
        let mut errors = Vec::new();
        for addr in replicas {
            match self.list(&addr).await {
                Ok(list) => return Ok((addr, list)),
                Err(e) => errors.push(format!("{addr}: {e:#}")),
            }
        }
        bail!("no scheduler replica answered: {}", errors.join("; "))
    }

    async fn list(&self, addr: &str) -> anyhow::Result<Vec<InstanceStatus>> {
        let channel = cluster_channel(addr, self.tls.as_ref(), CALL_TIMEOUT)?;
        let mut client = SchedulerClient::new(channel);
        let ask = auth::request(ListInstancesRequest {}, self.args.discovery.token.as_deref());
        let reply = tokio::time::timeout(CALL_TIMEOUT, client.list_instances(ask))
            .await
            .context("timed out")??;
        Ok(reply.into_inner().instances)
    }

    /// Drains the prefill whose gRPC service is at `addr`: requests left in flight.
    async fn drain(&self, addr: &str, grace_secs: u32) -> anyhow::Result<u32> {
        let channel = cluster_channel(addr, self.tls.as_ref(), CALL_TIMEOUT)?;
        let mut client = PrefillClient::new(channel);
        let ask = DrainRequest { grace_ms: grace_secs * 1000 };
        let ask = auth::request(ask, self.args.discovery.token.as_deref());
        let wait = CALL_TIMEOUT + Duration::from_secs(u64::from(grace_secs));
        let reply = tokio::time::timeout(wait, client.drain(ask)).await.context("timed out")??;
        Ok(reply.into_inner().left)
    }

    /// The evidence of the request with `room`, from the first frontend that remembers it.
    async fn trace(&self, room: u64, frontends: &[String]) -> anyhow::Result<(String, Value)> {
        if frontends.is_empty() {
            bail!("no frontend registered (or give --frontend HOST:PORT)");
        }
        let path = format!("/v1/debug/requests/{room}");
        let mut answers = Vec::new();
        for addr in frontends {
            let token = self.args.discovery.token.as_deref();
            match http::get(addr, &path, token, self.public.as_ref()).await {
                Ok((200, body)) => return Ok((addr.clone(), serde_json::from_str(&body)?)),
                Ok((code, body)) => answers.push(format!("{addr}: {code} {}", body.trim())),
                Err(e) => answers.push(format!("{addr}: {e:#}")),
            }
        }
        bail!("no frontend remembers room {room}: {}", answers.join("; "))
    }

    /// The rank table of the directory at `addr`: every (dp, cp, tp, pp) rank and its
    /// transfer endpoint, and whether all of them are registered.
    async fn directory(&self, addr: &str) -> anyhow::Result<Value> {
        let client =
            DirectoryClient::with_tls(self.args.discovery.token.clone(), self.tls.as_ref());
        let info = tokio::time::timeout(CALL_TIMEOUT, client.server_info(addr))
            .await
            .context("timed out")??;
        let dims = [info.dp_size, info.attn_cp_size, info.attn_tp_size, info.pp_size];
        let total = dims.iter().try_fold(1i64, |acc, d| acc.checked_mul(*d));
        if total.is_none_or(|t| t > 4096) {
            bail!("directory at {addr} claims too many ranks (dp/cp/tp/pp {dims:?})");
        }
        let mut ranks = Vec::new();
        let mut missing = 0;
        for dp in 0..info.dp_size {
            for cp in 0..info.attn_cp_size {
                for tp in 0..info.attn_tp_size {
                    for pp in 0..info.pp_size {
                        let (d, c, t, p) = (dp as u32, cp as u32, tp as u32, pp as u32);
                        let at = tokio::time::timeout(CALL_TIMEOUT, client.rank(addr, d, c, t, p));
                        let endpoint = match at.await {
                            Ok(Ok(r)) => json!(format!("{}:{}", r.rank_ip, r.rank_port)),
                            Ok(Err(e)) => {
                                missing += 1;
                                json!({"missing": e.to_string()})
                            }
                            Err(_) => {
                                missing += 1;
                                json!({"missing": "timed out"})
                            }
                        };
                        ranks.push(
                            json!({"dp": dp, "cp": cp, "tp": tp, "pp": pp, "endpoint": endpoint}),
                        );
                    }
                }
            }
        }
        Ok(json!({
            "directory": addr,
            "dp": info.dp_size, "cp": info.attn_cp_size, "tp": info.attn_tp_size, "pp": info.pp_size,
            "page_size": info.page_size,
            "kv_cache_dtype": info.kv_cache_dtype,
            "complete": missing == 0,
            "missing": missing,
            "ranks": ranks,
        }))
    }
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Prefill => "prefill",
        Role::Frontend => "frontend",
        Role::Scheduler => "scheduler",
        Role::Engine => "engine",
    }
}

fn instances_json(replica: &str, list: &[InstanceStatus], others: &[Instance]) -> Value {
    let instances: Vec<Value> = list
        .iter()
        .map(|i| {
            json!({
                "role": "prefill",
                "id": i.instance_id,
                "model": i.model,
                "dp": i.dp_size, "tp": i.tp_size, "pp": i.pp_size,
                "in_flight": i.in_flight,
                "breaker": if i.breaker_closed { "closed" } else { "open" },
                "routable": i.routable,
                "silent_ms": i.silent_ms,
                "cached_blocks": i.cached_blocks,
                "prefill_ns_per_token": i.prefill_ns_per_token,
                "send_ns_per_token": i.send_ns_per_token,
                "bootstrap_addr": i.bootstrap_addr,
                "grpc_addr": i.prefill_addr,
            })
        })
        .chain(others.iter().map(
            |s| json!({"role": role_name(s.role), "id": s.id.as_str(), "grpc_addr": s.grpc_addr}),
        ))
        .collect();
    json!({"asked": replica, "instances": instances})
}

fn instances_table(replica: &str, list: &[InstanceStatus], others: &[Instance]) -> String {
    let mut rows = vec![
        [
            "ROLE",
            "ID",
            "DP",
            "TP",
            "IN-FLIGHT",
            "BREAKER",
            "ROUTABLE",
            "LAST HEARD",
            "BLOCKS",
            "ADDRESS",
        ]
        .map(String::from),
    ];
    for i in list {
        rows.push([
            "prefill".into(),
            i.instance_id.clone(),
            i.dp_size.to_string(),
            i.tp_size.to_string(),
            i.in_flight.to_string(),
            (if i.breaker_closed { "closed" } else { "open" }).into(),
            (if i.routable { "yes" } else { "no" }).into(),
            format!("{:.1}s ago", i.silent_ms as f64 / 1000.0),
            i.cached_blocks.to_string(),
            i.prefill_addr.clone(),
        ]);
    }
    for s in others {
        let dash = || "-".to_owned();
        rows.push([
            role_name(s.role).into(),
            s.id.to_string(),
            dash(),
            dash(),
            dash(),
            dash(),
            dash(),
            dash(),
            dash(),
            s.grpc_addr.clone(),
        ]);
    }
    let mut out = format!("as seen by scheduler {replica}\n");
    out.push_str(&columns(&rows));
    out
}

fn directory_text(id: &str, t: &Value) -> String {
    let mut out = format!(
        "instance {id}: directory {} dp {} cp {} tp {} pp {}, page {} {}, {}\n",
        t["directory"].as_str().unwrap_or(""),
        t["dp"],
        t["cp"],
        t["tp"],
        t["pp"],
        t["page_size"],
        t["kv_cache_dtype"].as_str().unwrap_or(""),
        if t["complete"] == true {
            "complete".to_owned()
        } else {
            format!("INCOMPLETE: {} ranks missing", t["missing"])
        }
    );
    let mut rows = vec![["DP", "CP", "TP", "PP", "ENDPOINT"].map(String::from)];
    for r in t["ranks"].as_array().into_iter().flatten() {
        let endpoint = match &r["endpoint"] {
            Value::String(s) => s.clone(),
            other => format!("missing ({})", other["missing"].as_str().unwrap_or("?")),
        };
        rows.push([
            r["dp"].to_string(),
            r["cp"].to_string(),
            r["tp"].to_string(),
            r["pp"].to_string(),
            endpoint,
        ]);
    }
    out.push_str(&columns(&rows));
    out
}

fn trace_text(room: u64, frontend: &str, t: &Value) -> String {
    let mut out = format!(
        "room {room} (frontend {frontend}): {} after {:.1} ms{}\n",
        t["code"].as_str().unwrap_or("?"),
        t["took_ms"].as_f64().unwrap_or(0.0),
        match t["error"].as_str() {
            Some(e) if !e.is_empty() => format!(": {e}"),
            _ => String::new(),
        }
    );
    let stages = ["resolve_topology", "resolve_rank", "register", "connect", "verify", "consume"];
    let mut rows = vec![
        ["ATTEMPT", "ROOM", "INSTANCE", "DP", "STAGES (ms since the attempt began)", "ERROR"]
            .map(String::from),
    ];
    for (n, a) in t["attempts"].as_array().into_iter().flatten().enumerate() {
        let done: Vec<String> = stages
            .iter()
            .filter_map(|s| {
                let us = a["stages_us"][s].as_u64().filter(|&us| us > 0)?;
                Some(format!("{s} {:.1}", us as f64 / 1e3))
            })
            .collect();
        rows.push([
            (n + 1).to_string(),
            a["bootstrap_room"].to_string(),
            a["instance"].as_str().unwrap_or("").to_owned(),
            a["dp_rank"].to_string(),
            done.join(", "),
            a["error"].as_str().unwrap_or("").to_owned(),
        ]);
    }
    out.push_str(&columns(&rows));
    out
}

/// Rows as left-aligned columns, two spaces apart.
fn columns<const N: usize>(rows: &[[String; N]]) -> String {
    let mut widths = [0usize; N];
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r.iter().zip(widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out.pop();
    out
}
