use super::*;

#[test]
fn stored_events_carry_their_parent_and_accept_senders_without_it() {
    let ev = KvEvent {
        instance: "p0".parse().unwrap(),
        dp_rank: 1,
        seq: 7,
        incarnation: 0,
        kind: KvEventKind::Stored { parent: Some(BlockHash(9)), blocks: vec![BlockHash(10)] },
    };
    let json = serde_json::to_string(&ev).unwrap();
    assert!(json.contains(r#""parent":9"#), "{json}");
    assert_eq!(serde_json::from_str::<KvEvent>(&json).unwrap(), ev);
    // A sender that knows no parent (or predates the field) omits it.
    let old = r#"{"instance":"p0","dp_rank":0,"seq":1,"kind":{"type":"stored","blocks":[1,2]}}"#;
    let ev: KvEvent = serde_json::from_str(old).unwrap();
    assert_eq!(
        ev.kind,
        KvEventKind::Stored { parent: None, blocks: vec![BlockHash(1), BlockHash(2)] }
    );
    assert!(!serde_json::to_string(&ev).unwrap().contains("parent"));
}

#[test]
fn load_reports_round_trip() {
    let r = LoadReport {
        replica: "0123456789abcdef".into(),
        loads: vec![WorkerLoad {
            instance: "p1".parse().unwrap(),
            dp_rank: 0,
            in_flight: 2,
            queued_tokens: 300,
        }],
        routed: vec![],
    };
    let json = serde_json::to_vec(&r).unwrap();
    assert_eq!(serde_json::from_slice::<LoadReport>(&json).unwrap(), r);
    assert!(!String::from_utf8_lossy(&json).contains("routed"), "optional on the wire");
    let with = LoadReport {
        routed: vec![crate::RoutedPrefix {
            instance: "p1".parse().unwrap(),
            dp_rank: 1,
            blocks: vec![handoff_core::BlockHash(7), handoff_core::BlockHash(8)],
        }],
        ..r.clone()
    };
    let json = serde_json::to_vec(&with).unwrap();
    assert_eq!(serde_json::from_slice::<LoadReport>(&json).unwrap(), with);
    assert_eq!(load_subject(&r.replica), "handoff.v1.load.0123456789abcdef");
}
