use handoff_engine::{MockConfig, MockEngine};

use super::*;

#[test]
fn stop_strings_spanning_tokens_are_held_back_and_never_sent() {
    let e = MockEngine::new(MockConfig::default());
    // The mock renders token t as " w<t>".
    let mut a = TextAssembler::new(&["w12 w3".to_owned()]);
    let mut sent = String::new();
    let mut stopped = false;
    for t in [7, 12, 3, 9] {
        let r = a.push(&e, t);
        sent.push_str(&r.text);
        if r.stopped {
            stopped = true;
            break;
        }
    }
    assert!(stopped);
    assert_eq!(sent, " w7 ");
}

#[test]
fn without_stops_everything_is_released() {
    let e = MockEngine::new(MockConfig::default());
    let mut a = TextAssembler::new(&[]);
    let mut sent: String = [5, 6].iter().map(|&t| a.push(&e, t).text).collect();
    sent.push_str(&a.finish());
    assert_eq!(sent, " w5 w6");
    assert_eq!(a.released(), " w5 w6");
}

/// Tokens of one byte each, as a byte-level tokenizer may split a character.
fn bytes(tokens: &[u32]) -> String {
    String::from_utf8_lossy(&tokens.iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned()
}

/// Held-back text is searched for stop strings from a character's start: accented and CJK
/// text (several bytes a character, here a token a byte) with a stop string of two bytes or
/// more.
#[test]
fn stop_strings_are_found_in_text_of_any_script() {
    for (text, stop, expected) in [
        ("Très bien\n\nAu", "\n\n", "Très bien"),
        ("日本語です</s>x", "</s>", "日本語です"),
        ("üüü", "üü", ""),
        // The stop string ends where a character begins, unfinished.
        ("añ€", "añ", ""),
    ] {
        let mut a = TextAssembler::new(&[stop.to_owned()]);
        let mut sent = String::new();
        let mut stopped = false;
        for &b in text.as_bytes() {
            let r = a.push_decoded(bytes, u32::from(b));
            sent.push_str(&r.text);
            stopped |= r.stopped;
            if r.stopped {
                break;
            }
        }
        assert!(stopped, "{text:?} stops at {stop:?}");
        assert_eq!(sent, expected);
        assert_eq!(a.released(), expected);
    }
}

/// A long output is decoded a few tokens at a time, not whole at every token, and comes out
/// as decoding it whole would: text split mid-character, and an invalid byte.
#[test]
fn each_token_is_decoded_with_a_few_before_it_not_all() {
    let text = "Grüße aus 東京 🙂, ".repeat(100);
    let mut tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    tokens.insert(7, 0xff);
    let decoded = std::cell::Cell::new(0);
    let counting = |t: &[u32]| {
        decoded.set(decoded.get() + t.len());
        bytes(t)
    };
    let mut a = TextAssembler::new(&[]);
    let mut sent: String = tokens.iter().map(|&t| a.push_decoded(counting, t).text).collect();
    sent.push_str(&a.finish());
    assert_eq!(sent, bytes(&tokens));
    assert!(
        decoded.get() < 8 * tokens.len(),
        "{} tokens decoded for {}",
        decoded.get(),
        tokens.len()
    );
}

/// A token ending in the first byte of a character still releases (and stops at) the text
/// before it, as soon as it comes.
#[test]
fn the_text_before_an_unfinished_character_is_taken_at_once() {
    // Tokens of up to four bytes, the first in the lowest byte (no zero bytes).
    let packed = |t: &[u32]| {
        let b: Vec<u8> = t.iter().flat_map(|t| t.to_le_bytes()).filter(|&b| b != 0).collect();
        String::from_utf8_lossy(&b).into_owned()
    };
    let euro = "€".as_bytes();
    let b_and_euro_begun = u32::from_le_bytes([b'b', euro[0], 0, 0]);
    let mut a = TextAssembler::new(&["ab".to_owned()]);
    assert!(!a.push_decoded(packed, u32::from(b'a')).stopped);
    assert!(a.push_decoded(packed, b_and_euro_begun).stopped, "stops at the token with b");
    let mut a = TextAssembler::new(&[]);
    assert_eq!(a.push_decoded(packed, b_and_euro_begun).text, "b");
    let rest = u32::from_le_bytes([euro[1], euro[2], b'c', 0]);
    assert_eq!(a.push_decoded(packed, rest).text, "€c");
}

/// The last tokens ending mid-character send the characters before it, not a U+FFFD.
#[test]
fn an_unfinished_last_character_is_not_sent() {
    let mut a = TextAssembler::new(&[]);
    let mut sent: String =
        "ab€".bytes().take(4).map(|b| a.push_decoded(bytes, u32::from(b)).text).collect();
    sent.push_str(&a.finish());
    assert_eq!(sent, "ab");
}

/// Found in review: stray bytes that never make a character kept every later token waiting
/// and decoding the whole run again (quadratic); past what a character can take they go
/// out as U+FFFD, the text after them too, each token decoding a few.
#[test]
fn stray_bytes_are_given_out_and_not_decoded_again_and_again() {
    let decoded = std::cell::Cell::new(0);
    let counting = |t: &[u32]| {
        decoded.set(decoded.get() + t.len());
        bytes(t)
    };
    let mut a = TextAssembler::new(&[]);
    let mut stray: Vec<u32> = vec![0x80; 1000];
    stray.extend(b"ok".iter().map(|&b| u32::from(b)));
    let mut sent: String = stray.iter().map(|&t| a.push_decoded(counting, t).text).collect();
    sent.push_str(&a.finish());
    assert_eq!(sent, bytes(&stray), "as decoding them all at once");
    assert!(decoded.get() < 40 * stray.len(), "{} tokens decoded", decoded.get());
}

/// Tokens of up to four bytes, the first in the lowest byte (no zero bytes), decoded as
/// a byte-level decoder does; `count` adds up the tokens decoded.
fn packed_counting(count: &std::cell::Cell<usize>) -> impl Fn(&[u32]) -> String + '_ {
    |t: &[u32]| {
        count.set(count.get() + t.len());
        let b: Vec<u8> = t.iter().flat_map(|t| t.to_le_bytes()).filter(|&b| b != 0).collect();
        String::from_utf8_lossy(&b).into_owned()
    }
}

/// Packs `bytes` into tokens of up to four bytes, each as long as `len` says.
fn pack(bytes: &[u8], mut len: impl FnMut() -> usize) -> Vec<u32> {
    let mut tokens = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let (token, after) = rest.split_at(len().clamp(1, 4).min(rest.len()));
        let mut b = [0u8; 4];
        b[..token.len()].copy_from_slice(token);
        tokens.push(u32::from_le_bytes(b));
        rest = after;
    }
    tokens
}

/// Streams `tokens` through an assembler; the text sent and the tokens decoded.
fn stream(tokens: &[u32]) -> (String, usize) {
    let count = std::cell::Cell::new(0);
    let decode = packed_counting(&count);
    let mut a = TextAssembler::new(&[]);
    let mut sent: String = tokens.iter().map(|&t| a.push_decoded(&decode, t).text).collect();
    sent.push_str(&a.finish());
    (sent, count.get())
}

/// Found in review: stray bytes followed by a character's bytes, one a token, gave the
/// character out as U+FFFD too (the run was counted from the first stray byte); a token of
/// text and a character's first byte after a run of them kept the run growing.
#[test]
fn a_character_after_stray_bytes_is_still_waited_for() {
    let mut tokens: Vec<u32> = vec![0x80; 6];
    tokens.extend("😀".bytes().map(u32::from));
    assert_eq!(stream(&tokens).0, format!("{}😀", "\u{FFFD}".repeat(6)));

    let space_and_lead = u32::from_le_bytes([b' ', 0xF0, 0, 0]);
    let mut tokens = vec![space_and_lead; 500];
    tokens.extend([0x9F_u8, 0x98, 0x80].map(u32::from));
    let (sent, decoded) = stream(&tokens);
    let count = std::cell::Cell::new(0);
    assert_eq!(sent, packed_counting(&count)(&tokens), "as decoding them all at once");
    assert!(sent.ends_with(" 😀"));
    assert!(decoded < 40 * tokens.len(), "{decoded} tokens decoded");
}

/// Found in review: where every token ends one character and begins the next, the text is
/// never complete at a token's end, and the run was cut inside a character: a character sent
/// twice, or the rest of the text lost. Text cut into tokens anywhere, with stray bytes
/// among it, streams as decoding it all at once does, each token decoding a few.
#[test]
fn text_cut_anywhere_streams_as_it_decodes_whole() {
    let whole = "日本語の文章を書きます.";
    let mut first = true;
    let tokens = pack(whole.as_bytes(), || if std::mem::take(&mut first) { 1 } else { 3 });
    assert_eq!(stream(&tokens).0, whole, "tokens each ending a character and beginning the next");

    let pieces = ["日本語", "の", "😀", "é", " text ", "\u{80}", "ß"];
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    // Special tokens decode to nothing (token 0 here): no byte to count on.
    let mut tokens = pack("Hi €!".as_bytes(), || 1);
    tokens.splice(4..4, [0; 8]);
    assert_eq!(stream(&tokens).0, "Hi €!", "a character across tokens of no bytes");

    for trial in 0..200 {
        let mut bytes = Vec::new();
        for _ in 0..60 {
            match next() % 9 {
                8 => bytes.push(0x80),
                7 => bytes.push(0xF0),
                k => bytes.extend_from_slice(pieces[k as usize].as_bytes()),
            }
        }
        bytes.push(b'.');
        let mut tokens = pack(&bytes, || (next() % 4 + 1) as usize);
        for _ in 0..tokens.len() / 8 {
            let at = (next() % tokens.len() as u64) as usize;
            tokens.insert(at, 0);
        }
        let (sent, decoded) = stream(&tokens);
        let count = std::cell::Cell::new(0);
        assert_eq!(sent, packed_counting(&count)(&tokens), "trial {trial}: {bytes:x?}");
        assert!(decoded < 40 * tokens.len(), "trial {trial}: {decoded} tokens decoded");
    }
}
