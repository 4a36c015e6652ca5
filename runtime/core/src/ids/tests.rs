use super::*;

#[test]
fn minted_rooms_are_nonzero_u63_and_distinct() {
    let rooms: std::collections::HashSet<u64> = (0..10_000).map(|_| Room::mint().get()).collect();
    assert_eq!(rooms.len(), 10_000);
    assert!(rooms.iter().all(|&r| r != 0 && r < (1 << 63)));
}

#[test]
fn room_rejects_zero_and_u64_top_bit() {
    assert_eq!(Room::try_from(0), Err(InvalidId::Room(0)));
    assert!(Room::try_from(1 << 63).is_err());
    assert_eq!(Room::try_from(42).map(Room::get), Ok(42));
}

#[test]
fn instance_id_is_validated() {
    assert!("prefill-a.1_b".parse::<InstanceId>().is_ok());
    assert!("".parse::<InstanceId>().is_err());
    assert!("a/b".parse::<InstanceId>().is_err());
    assert!("x".repeat(129).parse::<InstanceId>().is_err());
}
