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

#[test]
fn rooms_minted_on_a_rank_map_to_it() {
    for ranks in [2u32, 3, 8] {
        for rank in 0..ranks {
            for _ in 0..200 {
                let r = Room::mint_on(rank, ranks).get();
                assert_eq!(r % u64::from(ranks), u64::from(rank), "{r} on {rank} of {ranks}");
                assert!(r != 0 && r <= Room::MAX);
            }
        }
    }
    // No ranks to choose among, or a rank out of range: any room.
    assert!(Room::mint_on(0, 1).get() > 0);
    assert!(Room::mint_on(5, 4).get() > 0);
    let distinct: std::collections::HashSet<u64> =
        (0..100).map(|_| Room::mint_on(1, 8).get()).collect();
    assert_eq!(distinct.len(), 100, "fresh");
}
