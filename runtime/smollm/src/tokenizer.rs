//! The tokenizer and chat template, both read from the GGUF file: a byte-level BPE
//! (`tokenizer.ggml.model = gpt2`) whose pre-tokenizer splits digits one by one (SmolLM's),
//! control tokens as special tokens, and ChatML.

use candle_core::quantized::gguf_file;
use handoff_engine::ChatMessage;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::SmolError;

/// Token type of control tokens in GGUF metadata.
const CONTROL: i32 = 3;

/// SmolLM2's system prompt when the conversation has none (from its chat template).
pub(crate) const DEFAULT_SYSTEM: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

fn strings(c: &gguf_file::Content, key: &str) -> Result<Vec<String>, SmolError> {
    let v = c.metadata.get(key).ok_or_else(|| SmolError::Format(format!("missing {key}")))?;
    v.to_vec()?.iter().map(|s| Ok(s.to_string()?.clone())).collect()
}

/// Builds the tokenizer from the GGUF metadata.
pub(crate) fn build(c: &gguf_file::Content) -> Result<Tokenizer, SmolError> {
    let model = c.metadata.get("tokenizer.ggml.model").map(|v| v.to_string().cloned());
    if !matches!(model, Some(Ok(ref m)) if m == "gpt2") {
        return Err(SmolError::Format(format!(
            "tokenizer model {model:?}, expected gpt2 (byte-level BPE)"
        )));
    }
    let tokens = strings(c, "tokenizer.ggml.tokens")?;
    let merges = strings(c, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| SmolError::Format(format!("merge {m:?}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let vocab: ahash::AHashMap<String, u32> =
        tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| SmolError::Format(e.to_string()))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(Sequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ])));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let types = c.metadata.get("tokenizer.ggml.token_type").map(|v| v.to_vec().cloned());
    if let Some(Ok(types)) = types {
        let special: Vec<AddedToken> = types
            .iter()
            .zip(&tokens)
            .filter(|(t, _)| t.to_i32().is_ok_and(|t| t == CONTROL))
            .map(|(_, s)| AddedToken::from(s.clone(), true))
            .collect();
        tok.add_special_tokens(&special);
    }
    Ok(tok)
}

/// The tokens that end a sequence: the file's end-of-sequence and end-of-turn tokens, and
/// those of ChatML and GPT-2 when the vocabulary has them (SmolLM2's file names `<|im_end|>`
/// alone; a completion that ends its text with `<|endoftext|>` ran on past it, its text
/// hidden as a special token's).
pub(crate) fn end_tokens(c: &gguf_file::Content, tokenizer: &Tokenizer) -> Vec<u32> {
    let named = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
        .into_iter()
        .filter_map(|k| c.metadata.get(k).and_then(|v| v.to_u32().ok()));
    let known = [END, "<|endoftext|>"].into_iter().filter_map(|t| tokenizer.token_to_id(t));
    let mut ends: Vec<u32> = named.chain(known).collect();
    ends.sort_unstable();
    ends.dedup();
    ends
}

/// The same tokenizer, reading control tokens written out as plain text (a chat message's
/// content).
pub(crate) fn plain(tokenizer: &Tokenizer) -> Tokenizer {
    let mut t = tokenizer.clone();
    t.set_encode_special_tokens(true);
    t
}

/// A piece of a rendered conversation: one of the template's control tokens, or text
/// between them (read as plain text, a message's content with it).
enum Piece {
    Start,
    End,
    Text(String),
}

const START: &str = "<|im_start|>";
const END: &str = "<|im_end|>";

/// The template's control tokens' ids.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChatIds {
    start: u32,
    end: u32,
}

/// The ids of the template's control tokens in `tokenizer`; a model without them cannot be
/// served chats (a load error, not each chat's).
pub(crate) fn chat_ids(tokenizer: &Tokenizer) -> Result<ChatIds, SmolError> {
    let id = |t: &str| {
        tokenizer
            .token_to_id(t)
            .ok_or_else(|| SmolError::Format(format!("no {t} token for the chat template")))
    };
    Ok(ChatIds { start: id(START)?, end: id(END)? })
}

/// A conversation in ChatML, with SmolLM2's default system prompt when the first message is
/// not a system message, the assistant's turn opened.
fn chatml_pieces(messages: &[ChatMessage]) -> Vec<Piece> {
    let mut pieces = Vec::with_capacity(4 * messages.len() + 6);
    let mut turn = |role: &str, content: &str| {
        pieces.push(Piece::Start);
        pieces.push(Piece::Text(format!("{role}\n{content}")));
        pieces.push(Piece::End);
        pieces.push(Piece::Text("\n".into()));
    };
    if messages.first().is_none_or(|m| m.role != "system") {
        turn("system", DEFAULT_SYSTEM);
    }
    for m in messages {
        turn(&m.role, &m.content);
    }
    pieces.push(Piece::Start);
    pieces.push(Piece::Text("assistant\n".into()));
    pieces
}

/// Renders a conversation in ChatML (see [`chatml_pieces`]).
pub(crate) fn chatml(messages: &[ChatMessage]) -> String {
    let mut s = String::new();
    for p in chatml_pieces(messages) {
        match p {
            Piece::Start => s.push_str(START),
            Piece::End => s.push_str(END),
            Piece::Text(t) => s.push_str(&t),
        }
    }
    s
}

/// A conversation's tokens: the template's control tokens as such (`chat`), the text
/// between them by `plain` (see [`plain`]). The same tokens as the rendered text's (the
/// tokenizer splits it at control tokens and encodes each piece between alone), but for
/// control tokens written in a message: text.
pub(crate) fn encode_chat(
    plain: &Tokenizer,
    chat: ChatIds,
    messages: &[ChatMessage],
) -> Result<Vec<u32>, tokenizers::Error> {
    let mut ids = Vec::new();
    for p in chatml_pieces(messages) {
        match p {
            Piece::Start => ids.push(chat.start),
            Piece::End => ids.push(chat.end),
            Piece::Text(t) => ids.extend_from_slice(plain.encode(t, false)?.get_ids()),
        }
    }
    Ok(ids)
}
