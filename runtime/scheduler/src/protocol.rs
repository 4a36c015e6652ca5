//! [`Protocol`]: how a routed instance is driven, and [`Protocols`]: the set a caller can
//! drive. A frontend that speaks handoff and SGLang is never handed a vLLM engine it could
//! not use; a router that drives engines itself asks for any.

use handoff_discovery::Instance;

use crate::SchedulerError;

/// How a routed instance is driven.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// A handoff prefill: its Prefill gRPC service, KV over the agent in its directory.
    #[default]
    Handoff,
    /// An SGLang prefill server (registered `kind=sglang` with a bootstrap directory): HTTP
    /// `/generate` with the bootstrap fields, KV over Mooncake per SGLang's PD protocol.
    Sglang,
    /// A vLLM prefill with its NIXL connector (registered `kind=vllm` with its side channel):
    /// HTTP `/v1/completions` with `kv_transfer_params`, KV READ over NIXL (vLLM's pull mode).
    Vllm,
    /// Any other engine: routers drive it themselves, over its own HTTP API.
    Engine,
}

impl Protocol {
    /// Every protocol, in wire-name order.
    pub const ALL: [Protocol; 4] =
        [Protocol::Handoff, Protocol::Sglang, Protocol::Vllm, Protocol::Engine];

    /// How `instance` is driven ([`Instance::protocol_name`]): engines by their registered
    /// kind; only SGLang servers with a bootstrap directory speak SGLang's PD protocol, and
    /// only vLLM servers with a NIXL side channel vLLM's.
    pub fn of(instance: &Instance) -> Protocol {
        match instance.protocol_name() {
            "handoff" => Protocol::Handoff,
            "sglang" => Protocol::Sglang,
            "vllm" => Protocol::Vllm,
            _ => Protocol::Engine,
        }
    }

    /// Its name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Handoff => "handoff",
            Protocol::Sglang => "sglang",
            Protocol::Vllm => "vllm",
            Protocol::Engine => "engine",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A set of protocols a caller can drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protocols(u8);

impl Protocols {
    /// Every instance, whatever it speaks.
    pub const ANY: Protocols = Protocols(0b1111);

    /// Whether `p` is in the set.
    pub fn contains(self, p: Protocol) -> bool {
        self.0 & p.bit() != 0
    }

    /// The set named on the wire (empty: any). Names this scheduler does not know are passed
    /// over (a newer caller may drive more): no instance here speaks them.
    pub fn from_names(names: &[String]) -> Result<Protocols, SchedulerError> {
        if names.is_empty() {
            return Ok(Protocols::ANY);
        }
        if names.len() > 64 {
            return Err(SchedulerError::Invalid(format!("{} protocols named", names.len())));
        }
        let known = names.iter().filter_map(|n| Protocol::ALL.into_iter().find(|p| p.name() == n));
        Ok(Protocols(known.fold(0, |set, p| set | p.bit())))
    }
}

impl From<Protocol> for Protocols {
    fn from(p: Protocol) -> Self {
        Protocols(p.bit())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_discovery::{EngineEndpoints, Role, Topology};

    fn instance(engine: Option<&str>, bootstrap: &str) -> Instance {
        Instance {
            id: "i-1".parse().unwrap(),
            role: Role::Prefill,
            model: String::new(),
            bootstrap_addr: bootstrap.into(),
            grpc_addr: "h:1".into(),
            topology: Topology { dp: 1, tp: 1, pp: 1, cp: 1 },
            page_size: 16,
            version: 1,
            engine: engine
                .map(|k| Box::new(EngineEndpoints { kind: k.into(), ..Default::default() })),
        }
    }

    #[test]
    fn instances_are_driven_by_what_they_registered() {
        assert_eq!(Protocol::of(&instance(None, "h:2")), Protocol::Handoff);
        assert_eq!(Protocol::of(&instance(Some("sglang"), "h:8998")), Protocol::Sglang);
        assert_eq!(Protocol::of(&instance(Some("sglang"), "")), Protocol::Engine, "no directory");
        assert_eq!(Protocol::of(&instance(Some("vllm"), "h:5600")), Protocol::Vllm);
        assert_eq!(Protocol::of(&instance(Some("vllm"), "")), Protocol::Engine, "no side channel");
        assert_eq!(Protocol::of(&instance(Some("trt"), "h:2")), Protocol::Engine);
    }

    #[test]
    fn sets_parse_from_names_and_unknown_names_are_passed_over() {
        let set = Protocols::from_names(&["handoff".into(), "nixl".into(), "sglang".into()]);
        let set = set.unwrap();
        assert!(set.contains(Protocol::Handoff) && set.contains(Protocol::Sglang));
        assert!(!set.contains(Protocol::Engine));
        assert_eq!(Protocols::from_names(&[]).unwrap(), Protocols::ANY);
        let none = Protocols::from_names(&["nixl".into()]).unwrap();
        assert!(Protocol::ALL.iter().all(|&p| !none.contains(p)), "nothing here speaks nixl");
        assert!(Protocols::from_names(&vec!["x".to_owned(); 65]).is_err(), "bounded");
    }
}
