//! `--engine SPEC`: an engine instance (vLLM, SGLang) the scheduler routes to, without
//! discovery: `id=NAME,events=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,dp=N][,page=N]
//! [,url=HOST:PORT][,health=HOST:PORT][,bootstrap=HOST:PORT][,side=HOST:PORT][,model=NAME]
//! [,topic=TOPIC][,kind=vllm|sglang|...]`.
//!
//! dp rank r publishes on the events (and replay) port + r, as vLLM and SGLang do. `page` is
//! the page size requests hash their prompts with (ours; default the scheduler's
//! `--page-size`), whatever the engine's block size. `url` is where routers send the
//! engine's requests; `health` (default `url`) answers `GET /health`. `bootstrap` is an
//! SGLang prefill server's disaggregation bootstrap port (`--disaggregation-bootstrap-port`):
//! with `kind=sglang` and `url`, handoff frontends drive it as a prefill (protocol `sglang`).
//! `side` is a vLLM prefill's NIXL side channel (`VLLM_NIXL_SIDE_CHANNEL_HOST` and `_PORT`):
//! with `kind=vllm` and `url`, handoff frontends drive it as a prefill (protocol `vllm`),
//! asking that host only for its ranks' NIXL metadata. Either is kept as the instance's
//! bootstrap address.

use handoff_discovery::{EngineEndpoints, Instance, Role, Topology};
use handoff_kv_events::EngineEndpoint;
use handoff_scheduler::engine::EngineSpec;

/// An engine spec as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineArg {
    id: String,
    events: (String, u16),
    replay: Option<(String, u16)>,
    dp: u32,
    page: Option<u32>,
    url: String,
    health: Option<String>,
    bootstrap: String,
    model: String,
    topic: String,
    kind: String,
}

/// `tcp://host:port`.
fn tcp(s: &str) -> Result<(String, u16), String> {
    let rest = s.strip_prefix("tcp://").ok_or_else(|| format!("{s:?} is not tcp://HOST:PORT"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("{s:?} has no port"))?;
    let port = port.parse().map_err(|e| format!("{s:?}: port: {e}"))?;
    Ok((host.to_owned(), port))
}

/// Parses `--engine`.
pub fn engine_arg(s: &str) -> Result<EngineArg, String> {
    let mut fields = std::collections::HashMap::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').ok_or_else(|| format!("{part:?} is not KEY=VALUE"))?;
        if fields.insert(k, v).is_some() {
            return Err(format!("{k} given twice"));
        }
    }
    let need = |k: &str| fields.get(k).copied().ok_or_else(|| format!("{k}= is required"));
    let number = |k: &str, default: u32| -> Result<u32, String> {
        fields.get(k).map_or(Ok(default), |v| {
            v.parse::<u32>()
                .ok()
                .filter(|n| (1..=1024).contains(n))
                .ok_or_else(|| format!("{k}={v} is not a number from 1 to 1024"))
        })
    };
    let known = [
        "id",
        "events",
        "replay",
        "dp",
        "page",
        "url",
        "health",
        "bootstrap",
        "side",
        "model",
        "topic",
        "kind",
    ];
    if let Some(k) = fields.keys().find(|k| !known.contains(k)) {
        return Err(format!("unknown key {k:?} (known: {})", known.join(", ")));
    }
    let id = need("id")?.to_owned();
    id.parse::<handoff_core::InstanceId>().map_err(|e| format!("id: {e}"))?;
    let events = tcp(need("events")?)?;
    let replay = fields.get("replay").map(|r| tcp(r)).transpose()?;
    let dp = number("dp", 1)?;
    for (what, port) in [("events", Some(events.1)), ("replay", replay.as_ref().map(|r| r.1))] {
        if let Some(p) = port
            && u32::from(p) + dp > 65536
        {
            return Err(format!("{what} port {p} + {dp} dp ranks overflows"));
        }
    }
    for k in ["url", "health", "bootstrap", "side"] {
        if let Some(v) = fields.get(k)
            && (v.contains("://")
                || v.rsplit_once(':').is_none_or(|(_, p)| p.parse::<u16>().is_err()))
        {
            return Err(format!("{k}={v} is not HOST:PORT"));
        }
    }
    if !fields.contains_key("url") && !fields.contains_key("health") {
        return Err("give health= (or url=): an engine is live while it answers GET /health".into());
    }
    if fields.contains_key("bootstrap")
        && (fields.get("kind") != Some(&"sglang") || !fields.contains_key("url"))
    {
        return Err("bootstrap= is an SGLang prefill's: give it with kind=sglang and url=".into());
    }
    if fields.contains_key("side")
        && (fields.get("kind") != Some(&"vllm") || !fields.contains_key("url"))
    {
        return Err(
            "side= is a vLLM prefill's NIXL side channel: give it with kind=vllm and url=".into()
        );
    }
    Ok(EngineArg {
        id,
        events,
        replay,
        dp,
        page: fields.contains_key("page").then(|| number("page", 16)).transpose()?,
        url: fields.get("url").map(|u| u.to_string()).unwrap_or_default(),
        health: fields.get("health").or(fields.get("url")).map(|h| h.to_string()),
        bootstrap: fields
            .get("bootstrap")
            .or(fields.get("side"))
            .map(|b| b.to_string())
            .unwrap_or_default(),
        model: fields.get("model").map(|m| m.to_string()).unwrap_or_default(),
        topic: fields.get("topic").map(|t| t.to_string()).unwrap_or_default(),
        kind: fields.get("kind").map(|k| k.to_string()).unwrap_or_default(),
    })
}

impl EngineArg {
    /// Its id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Its registration in discovery (role engine), for the schedulers that follow
    /// registered engines; without `page=`, `page_size`.
    pub fn registration(&self, page_size: u32) -> Instance {
        Instance { role: Role::Engine, ..self.spec(page_size).instance }
    }

    /// What the scheduler follows; without `page=`, `page_size` (the scheduler's
    /// `--page-size`, which requests share).
    pub fn spec(&self, page_size: u32) -> EngineSpec {
        let at =
            |(host, port): &(String, u16), r: u32| format!("tcp://{host}:{}", *port as u32 + r);
        let events: Vec<EngineEndpoint> = (0..self.dp)
            .map(|r| EngineEndpoint {
                events: at(&self.events, r),
                replay: self.replay.as_ref().map(|p| at(p, r)),
                topic: self.topic.clone(),
            })
            .collect();
        let endpoints = EngineEndpoints {
            kind: self.kind.clone(),
            events: events.iter().map(|e| e.events.clone()).collect(),
            replay: events.iter().map(|e| e.replay.clone().unwrap_or_default()).collect(),
            topic: self.topic.clone(),
            health: self.health.clone(),
        };
        let instance = Instance {
            id: self.id.parse().unwrap_or_else(|_| unreachable!("checked when parsed")),
            role: Role::Prefill,
            model: self.model.clone(),
            bootstrap_addr: self.bootstrap.clone(),
            grpc_addr: self.url.clone(),
            topology: Topology { dp: self.dp, tp: 1, pp: 1, cp: 1 },
            page_size: self.page.unwrap_or(page_size),
            version: rand::random::<u64>() | 1,
            engine: Some(Box::new(endpoints)),
        };
        EngineSpec {
            instance,
            events,
            health: self.health.clone(),
            probe_every: handoff_scheduler::engine::PROBE_EVERY,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_say_why() {
        let e = engine_arg("id=vllm-a,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5567,dp=2,url=10.0.0.5:8000").unwrap();
        let s = e.spec(16);
        assert_eq!(s.events.len(), 2);
        assert_eq!(s.events[1].events, "tcp://10.0.0.5:5558");
        assert_eq!(s.events[1].replay.as_deref(), Some("tcp://10.0.0.5:5568"));
        assert_eq!((s.instance.page_size, s.health.as_deref()), (16, Some("10.0.0.5:8000")));
        let back = EngineSpec::from_registration(e.registration(16)).expect("a full registration");
        assert_eq!(back.events, s.events, "what a scheduler follows from etcd is the same");
        assert_eq!((back.health, back.instance.role), (s.health, Role::Engine));
        let g = engine_arg("id=sgl-a,events=tcp://h:5557,kind=sglang,url=h:30000,bootstrap=h:8998")
            .unwrap();
        let back = EngineSpec::from_registration(g.registration(16)).unwrap();
        assert_eq!(back.instance.bootstrap_addr, "h:8998");
        assert_eq!(handoff_scheduler::Protocol::of(&back.instance).name(), "sglang");
        assert_eq!(handoff_scheduler::Protocol::of(&g.spec(16).instance).name(), "sglang");
        assert_eq!(handoff_scheduler::Protocol::of(&s.instance).name(), "engine");
        let v = engine_arg("id=v-a,events=tcp://h:5557,kind=vllm,url=h:8000,side=h:5600").unwrap();
        let back = EngineSpec::from_registration(v.registration(16)).unwrap();
        assert_eq!(back.instance.bootstrap_addr, "h:5600");
        assert_eq!(handoff_scheduler::Protocol::of(&back.instance).name(), "vllm");
        for (bad, why) in [
            ("events=tcp://h:1,url=h:2", "id= is required"),
            ("id=a,url=h:2", "events= is required"),
            ("id=a,events=http://h:1,url=h:2", "tcp://"),
            ("id=a,events=tcp://h:1,dp=0,url=h:2", "dp=0"),
            ("id=a,events=tcp://h:1,colour=red,url=h:2", "unknown key"),
            ("id=a,id=b,events=tcp://h:1,url=h:2", "twice"),
            ("id=a,events=tcp://h:65535,dp=2,url=h:2", "overflows"),
            ("id=a,events=tcp://h:1,replay=tcp://h:65535,dp=2,url=h:2", "replay port"),
            ("id=a,events=tcp://h:1,url=http://h:2", "HOST:PORT"),
            ("id=a,events=tcp://h:1", "health="),
            ("id=a,events=tcp://h:1,url=h:2,bootstrap=h:3", "kind=sglang"),
            ("id=a,events=tcp://h:1,kind=sglang,health=h:2,bootstrap=h:3", "url="),
            ("id=a,events=tcp://h:1,kind=sglang,url=h:2,bootstrap=h", "HOST:PORT"),
            ("id=a,events=tcp://h:1,kind=sglang,url=h:2,side=h:3", "kind=vllm"),
            ("id=a,events=tcp://h:1,kind=vllm,health=h:2,side=h:3", "url="),
            ("id=a,events=tcp://h:1,kind=vllm,url=h:2,side=h", "HOST:PORT"),
        ] {
            let e = engine_arg(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
