//! SGLang 0.5.23's ZMQ messages between a decode and a Mooncake prefill
//! (`../shared/interop/sglang-kv.md` §3, `sglang-sender.md` §5): multipart frames, scalars
//! as ASCII decimals, pointer and index arrays as little-endian bytes.

use bytes::Bytes;

use crate::SglangError;

/// The decode's registration with one prefill rank (20 frames, frame 0 `None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// Where the decode's PULL socket listens.
    pub decode_ip: String,
    /// Its port.
    pub decode_port: u16,
    /// The decode's Mooncake segment name (`ip:port`): how the prefill names this decode.
    pub session: String,
    /// Destination K/V buffers: all K, then all V.
    pub kv_ptrs: Vec<u64>,
    /// Destination metadata buffers, in SGLang's order.
    pub aux_ptrs: Vec<u64>,
    /// The decode's tp rank.
    pub dst_tp_rank: u32,
    /// Its attention tp size.
    pub dst_attn_tp_size: u32,
    /// Bytes of one page of one buffer.
    pub kv_item_len: u64,
}

fn ascii(v: impl ToString) -> Bytes {
    Bytes::from(v.to_string())
}

fn u64s(v: &[u64]) -> Bytes {
    Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
}

impl Registration {
    /// The frames, as `build_receiver_registration_message` sends them.
    pub fn frames(&self) -> Vec<Bytes> {
        let empty = Bytes::new;
        vec![
            Bytes::from_static(b"None"),
            ascii(&self.decode_ip),
            ascii(self.decode_port),
            ascii(&self.session),
            u64s(&self.kv_ptrs),
            u64s(&self.aux_ptrs),
            empty(), // state pointers: none
            ascii(self.dst_tp_rank),
            ascii(self.dst_attn_tp_size),
            ascii(self.kv_item_len),
            empty(),  // state item lengths
            empty(),  // state dims per tensor
            empty(),  // kv layer ids (a plain MHA pool publishes none)
            empty(),  // state layer ids
            empty(),  // staging base pointer
            empty(),  // staging size
            ascii(1), // dcp size
            ascii(0), // dcp rank
            empty(),  // staging slot layer ids
            u64s(&vec![self.kv_item_len; self.kv_ptrs.len()]),
        ]
    }
}

/// One request's transfer info for one prefill rank (10 frames).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferInfo {
    /// The room.
    pub room: u64,
    /// Where the decode's PULL socket listens.
    pub decode_ip: String,
    /// Its port.
    pub decode_port: u16,
    /// The decode's segment name, as registered.
    pub session: String,
    /// Destination page indices.
    pub pages: Vec<i32>,
    /// Destination metadata row.
    pub aux_index: u32,
    /// How many decode ranks the prefill waits for.
    pub required_dst_info_num: u32,
}

impl TransferInfo {
    /// The frames, as `build_receiver_metadata_message` sends them.
    pub fn frames(&self) -> Vec<Bytes> {
        let pages: Vec<u8> = self.pages.iter().flat_map(|p| p.to_le_bytes()).collect();
        vec![
            ascii(self.room),
            ascii(&self.decode_ip),
            ascii(self.decode_port),
            ascii(&self.session),
            Bytes::from(pages),
            ascii(self.aux_index),
            Bytes::new(), // state indices
            ascii(self.required_dst_info_num),
            ascii(0),     // decode prefix length
            Bytes::new(), // device kv indices
        ]
    }
}

/// What a prefill sends a decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inbound {
    /// `[room, status, prefill_rank]`: 4 is success, 0 failure.
    Status {
        /// The room.
        room: u64,
        /// `KVPoll` as a number.
        status: u8,
        /// The prefill's unique rank.
        rank: u32,
    },
    /// A metadata row sent over ZMQ instead of Mooncake (`SGLANG_MOONCAKE_SEND_AUX_TCP`).
    AuxData {
        /// The room.
        room: u64,
        /// Which metadata buffer.
        buffer: usize,
        /// Which row of it.
        row: u32,
        /// The row's bytes.
        data: Bytes,
    },
}

/// `KVPoll.Success`.
pub const STATUS_SUCCESS: u8 = 4;
/// `KVPoll.Failed`.
pub const STATUS_FAILED: u8 = 0;

fn number<T: std::str::FromStr>(frame: &Bytes, what: &str) -> Result<T, SglangError> {
    std::str::from_utf8(frame).ok().and_then(|s| s.parse().ok()).ok_or_else(|| {
        SglangError::Malformed(format!("{what}: {:?}", String::from_utf8_lossy(frame)))
    })
}

impl Inbound {
    /// Parses a message from a prefill.
    pub fn parse(frames: &[Bytes]) -> Result<Self, SglangError> {
        match frames {
            [tag, room, buffer, row, len, data] if tag.as_ref() == b"AUX_DATA" => {
                let declared: [u8; 4] = len.as_ref().try_into().map_err(|_| {
                    SglangError::Malformed(format!("AUX_DATA length of {} bytes", len.len()))
                })?;
                if u32::from_be_bytes(declared) as usize != data.len() {
                    return Err(SglangError::Malformed(format!(
                        "AUX_DATA says {} bytes, carries {}",
                        u32::from_be_bytes(declared),
                        data.len()
                    )));
                }
                Ok(Inbound::AuxData {
                    room: number(room, "room")?,
                    buffer: number(buffer, "aux buffer")?,
                    row: number(row, "aux row")?,
                    data: data.clone(),
                })
            }
            [room, status, rank] => Ok(Inbound::Status {
                room: number(room, "room")?,
                status: number(status, "status")?,
                rank: number(rank, "prefill rank")?,
            }),
            other => Err(SglangError::Malformed(format!("a message of {} frames", other.len()))),
        }
    }

    /// The room it is about.
    pub fn room(&self) -> u64 {
        match self {
            Inbound::Status { room, .. } | Inbound::AuxData { room, .. } => *room,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        s.split_whitespace().map(|b| u8::from_str_radix(b, 16).unwrap()).collect()
    }

    /// The registration SGLang's own receiver sent (sglang-sender.md §5.3), pointers included.
    #[test]
    fn registration_frames_match_sglangs() {
        let r = Registration {
            decode_ip: "127.0.0.1".into(),
            decode_port: 37445,
            session: "127.0.0.1:16721".into(),
            kv_ptrs: vec![0x562e_c354_d570, 0x562e_c355_1780, 0x562e_c355_5990, 0x562e_c355_9ba0],
            aux_ptrs: vec![1; 10],
            dst_tp_rank: 0,
            dst_attn_tp_size: 1,
            kv_item_len: 512,
        };
        let f = r.frames();
        assert_eq!(f.len(), 20);
        assert_eq!(&f[0][..], b"None");
        assert_eq!(
            (&f[1][..], &f[2][..], &f[3][..]),
            (&b"127.0.0.1"[..], &b"37445"[..], &b"127.0.0.1:16721"[..])
        );
        let want = hex(
            "70 d5 54 c3 2e 56 00 00 80 17 55 c3 2e 56 00 00 90 59 55 c3 2e 56 00 00 a0 9b 55 c3 2e 56 00 00",
        );
        assert_eq!(f[4].to_vec(), want);
        assert_eq!(f[5].len(), 80);
        assert_eq!((&f[7][..], &f[8][..], &f[9][..]), (&b"0"[..], &b"1"[..], &b"512"[..]));
        assert!(f[6].is_empty() && (10..16).all(|i| f[i].is_empty()) && f[18].is_empty());
        assert_eq!((&f[16][..], &f[17][..]), (&b"1"[..], &b"0"[..]));
        assert_eq!(f[19].to_vec(), hex("00 02 00 00 00 00 00 00").repeat(4));
    }

    #[test]
    fn transfer_info_frames_match_sglangs() {
        let t = TransferInfo {
            room: 0x0123_4567_89ab_cdef,
            decode_ip: "127.0.0.1".into(),
            decode_port: 37445,
            session: "127.0.0.1:16721".into(),
            pages: vec![7, 8, 2, 3],
            aux_index: 5,
            required_dst_info_num: 1,
        };
        let f = t.frames();
        assert_eq!(f.len(), 10);
        assert_eq!(&f[0][..], b"81985529216486895");
        assert_eq!(f[4].to_vec(), hex("07 00 00 00 08 00 00 00 02 00 00 00 03 00 00 00"));
        assert_eq!((&f[5][..], &f[7][..], &f[8][..]), (&b"5"[..], &b"1"[..], &b"0"[..]));
        assert!(f[6].is_empty() && f[9].is_empty());
    }

    #[test]
    fn status_and_aux_data_parse_and_bad_messages_are_named() {
        let b = |s: &[u8]| Bytes::copy_from_slice(s);
        let s = Inbound::parse(&[b(b"81985529216486895"), b(b"4"), b(b"0")]).unwrap();
        assert_eq!(s, Inbound::Status { room: 0x0123_4567_89ab_cdef, status: 4, rank: 0 });
        let row = [0xefu8, 0xcd, 0xab, 0x89, 0x67, 0x45, 0x23, 0x01].repeat(8);
        let aux = [
            b(b"AUX_DATA"),
            b(b"81985529216486895"),
            b(b"9"),
            b(b"5"),
            b(&[0, 0, 0, 0x40]),
            b(&row),
        ];
        let a = Inbound::parse(&aux).unwrap();
        assert_eq!(a.room(), 0x0123_4567_89ab_cdef);
        assert!(
            matches!(a, Inbound::AuxData { buffer: 9, row: 5, ref data, .. } if data.len() == 64)
        );
        let mut short = aux.clone();
        short[4] = b(&[0, 0, 0, 0x41]);
        assert!(Inbound::parse(&short).is_err());
        for bad in
            [vec![b(b"x")], vec![b(b"room"), b(b"4"), b(b"0")], vec![b(b"1"), b(b"four"), b(b"0")]]
        {
            assert!(Inbound::parse(&bad).is_err(), "{bad:?}");
        }
    }
}
