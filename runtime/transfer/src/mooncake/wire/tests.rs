//! Golden bytes: frames captured between two copies of the wheel 0.3.13.post1
//! (`../shared/interop/mooncake-tcp.md` §1c).

use super::*;

/// The descriptor the wheel sent, byte for byte.
const DESCRIPTOR: &str = r#"{"buffers":[{"addr":140192636321808,"length":1048576,"name":"127.0.0.1:16779"}],"name":"127.0.0.1:16779","protocol":"tcp","rdma_server_name":"","tcp_data_host":"127.0.0.1","tcp_data_port":15835,"tcp_proto_version":2,"timestamp":"2026-11-30 19:01:30.923463"}"#;

fn hex(s: &str) -> Vec<u8> {
    s.split_whitespace().map(|b| u8::from_str_radix(b, 16).unwrap()).collect()
}

#[test]
fn the_captured_write_header_decodes_and_encodes_back() {
    let wire = hex("64 00 00 00 00 00 00 00 70 d2 22 0a f1 55 00 00 81 00 00 00 00 00 00 00");
    let h = Header::decode(wire.as_slice().try_into().unwrap());
    assert_eq!(h, Header { size: 100, addr: 0x55f1_0a22_d270, opcode: 0x81 });
    assert!(h.v2() && h.is_write());
    assert_eq!(h.encode().to_vec(), wire);
    let read = hex("20 00 00 00 00 00 00 00 70 d2 22 0a f1 55 00 00 80 00 00 00 00 00 00 00");
    let r = Header::decode(read.as_slice().try_into().unwrap());
    assert!(r.v2() && !r.is_write() && r.size == 32);
    // Padding is ignored (the C struct's is uninitialized).
    let mut junk = wire.clone();
    junk[17..].fill(0xab);
    assert_eq!(Header::decode(junk.as_slice().try_into().unwrap()), h);
}

#[test]
fn the_captured_status_words() {
    let ok = u64::from_le_bytes(hex("00 00 00 00 56 54 43 4d").try_into().unwrap());
    let rejected = u64::from_le_bytes(hex("01 00 00 00 56 54 43 4d").try_into().unwrap());
    assert_eq!((ok, rejected), (STATUS_OK, STATUS_REJECTED));
    assert_eq!(status(ok), Status::Ok);
    assert_eq!(status(rejected), Status::Rejected);
    assert_eq!(status(7), Status::Unknown(7));
}

#[test]
fn the_captured_descriptor_parses_and_reencodes_byte_for_byte() {
    let d = SegmentDesc::parse(DESCRIPTOR.as_bytes()).unwrap();
    assert_eq!(d.tcp_data_port, 15835);
    assert_eq!(d.tcp_proto_version, 2);
    assert_eq!(d.buffers[0].addr, 140_192_636_321_808);
    assert_eq!(d.to_json(), format!("{DESCRIPTOR}\n").into_bytes());
    // Framed as the wheel framed its reply: length 1 + JSON, type 1.
    let frame = encode_frame(FrameType::Metadata, &d.to_json());
    assert_eq!(frame[..9], [0x03, 0x01, 0, 0, 0, 0, 0, 0, 0x01][..], "{:02x?}", &frame[..9]);
}

#[test]
fn descriptors_are_read_tolerantly_and_refused_whole_when_a_buffer_is_empty() {
    let old = r#"{"name":"h:1","protocol":"tcp","tcp_data_port":9,"extra":[1,2]}"#;
    let d = SegmentDesc::parse(old.as_bytes()).unwrap();
    assert_eq!((d.tcp_proto_version, d.tcp_data_host.as_deref()), (1, None));
    let empty = DESCRIPTOR.replace("1048576", "0");
    assert!(SegmentDesc::parse(empty.as_bytes()).is_err());
    let rdma = DESCRIPTOR.replace(r#""tcp""#, r#""rdma""#);
    assert!(SegmentDesc::parse(rdma.as_bytes()).is_err());
    assert!(SegmentDesc::parse(b"{").is_err());
}

#[tokio::test]
async fn frames_are_bounded_and_legacy_bodies_read_as_connection() {
    let read = |bytes: Vec<u8>| async move { read_frame(&mut bytes.as_slice()).await };
    let (t, body) = read(encode_frame(FrameType::Probe, b"{}\n")).await.unwrap();
    assert_eq!((t, body.as_slice()), (FrameType::Probe, &b"{}\n"[..]));
    // No type byte: the whole body is legacy JSON.
    let mut legacy = 2u64.to_le_bytes().to_vec();
    legacy.extend_from_slice(b"{}");
    assert_eq!(read(legacy).await.unwrap(), (FrameType::Connection, b"{}".to_vec()));
    for len in [0, MAX_HANDSHAKE + 1, u64::MAX] {
        assert!(read(len.to_le_bytes().to_vec()).await.is_err(), "length {len}");
    }
    let mut short = 10u64.to_le_bytes().to_vec();
    short.extend_from_slice(b"\x01{}");
    assert!(read(short).await.is_err(), "cut short");
}
