//! Turning generated tokens into streamed text: byte-level tokenizers can split a character
//! across tokens, and a stop string can span tokens, so text is released only once it is
//! complete and cannot be the start of a stop string; a matched stop string is never sent.

use handoff_engine::Engine;

/// Accumulates tokens and releases text.
#[derive(Debug, Default)]
pub struct TextAssembler {
    tokens: Vec<u32>,
    /// Where the tokens still decoded at each step begin: only a few tokens before the
    /// newest are decoded again (the text of those before is settled), so a long output
    /// costs linear, not quadratic, decoding.
    window: usize,
    /// The tokens of `window..read` were decoded into `text` already.
    read: usize,
    /// Bytes of the text of the tokens past `read` in `text` already (the characters before
    /// an unfinished one).
    shown: usize,
    text: String,
    released: usize,
    stops: Vec<String>,
    hold: usize,
}

/// The most bytes a UTF-8 character takes: with every token at least a byte, a character
/// that is still unfinished, or finished by the newest token, began in the last this many.
const MAX_CHAR_BYTES: usize = 4;

/// Tokens the unsettled run may hold before those of it more than [`MAX_CHAR_BYTES`] back
/// are given out as they decode, bytes that never became a character as U+FFFD (a model's
/// stray byte tokens): a run of them is not decoded again at each token.
const MAX_UNFINISHED: usize = 2 * MAX_CHAR_BYTES;

/// What one token released.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    /// New text for the client.
    pub text: String,
    /// A stop string matched: generation ends here.
    pub stopped: bool,
}

impl TextAssembler {
    /// An assembler that ends at any of `stops`.
    pub fn new(stops: &[String]) -> Self {
        let hold = stops.iter().map(String::len).max().unwrap_or(1).saturating_sub(1);
        TextAssembler { stops: stops.to_vec(), hold, ..Self::default() }
    }

    /// Adds a token; returns the text it releases.
    pub fn push(&mut self, engine: &dyn Engine, token: u32) -> Released {
        self.push_decoded(|t| engine.detokenize(t), token)
    }

    /// [`TextAssembler::push`] with `decode` turning tokens into text. The tokens from
    /// `window` are decoded twice, up to `read` and up to the newest: the difference is the
    /// new text, decoded with the tokens before it (byte-level and SentencePiece decoders
    /// render a token by its neighbours). An unfinished character decodes as U+FFFD at the
    /// end: what comes before it is taken (`shown`), and the window waits for the rest.
    pub(crate) fn push_decoded(
        &mut self,
        decode: impl Fn(&[u32]) -> String,
        token: u32,
    ) -> Released {
        self.tokens.push(token);
        if self.tokens.len() - self.read > MAX_UNFINISHED {
            self.settle_stray(&decode);
        }
        let settled = decode(&self.tokens[self.window..self.read]);
        let now = decode(&self.tokens[self.window..]);
        // Past what the two have in common (all of `settled` but for decoders that tidy
        // spaces by the next token, whose change is already sent).
        let new = &now[common_prefix(&settled, &now)..];
        let complete = new.trim_end_matches('\u{FFFD}');
        if let Some(more) = complete.get(self.shown..) {
            self.text.push_str(more);
            self.shown = complete.len();
        }
        if complete.len() == new.len() {
            (self.window, self.read, self.shown) = (self.read, self.tokens.len(), 0);
        }
        self.release()
    }

    /// Settles the unsettled run but for its last [`MAX_CHAR_BYTES`] tokens that decode to
    /// something (a special token decodes to nothing), which hold the start of any character
    /// still to finish. What the tokens before the cut decode to is taken as far as the
    /// whole run decodes alike (bytes that never made a character as U+FFFD); a character the
    /// cut splits (its first bytes before it, the rest after) is not: the next step decodes it
    /// whole from before the cut. Text already shown past what is taken stays counted as shown.
    fn settle_stray(&mut self, decode: &impl Fn(&[u32]) -> String) {
        let mut with_bytes = 0;
        let Some(cut) = (self.read + 1..self.tokens.len()).rev().find(|&i| {
            with_bytes += usize::from(!decode(&self.tokens[i..=i]).is_empty());
            with_bytes == MAX_CHAR_BYTES
        }) else {
            return;
        };
        let settled = decode(&self.tokens[self.window..self.read]);
        let upto = decode(&self.tokens[self.window..cut]);
        let now = decode(&self.tokens[self.window..]);
        let kept = &upto[..common_prefix(&upto, &now)];
        let new = kept.get(common_prefix(&settled, kept)..).unwrap_or_default();
        if let Some(more) = new.get(self.shown..) {
            self.text.push_str(more);
        }
        let shown = self.shown.saturating_sub(new.len());
        (self.window, self.read, self.shown) = (self.read, cut, shown);
    }

    /// Looks for stop strings in the text not yet released; returns the text it releases.
    fn release(&mut self) -> Released {
        // A stop string may begin in the held-back text: look from `hold` bytes before what
        // was released, moved back to a character's start (the text may be any script).
        let mut from = self.released.saturating_sub(self.hold).min(self.text.len());
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min()
        {
            let out = self.text.get(self.released..at).unwrap_or_default().to_owned();
            self.released = at.max(self.released);
            return Released { text: out, stopped: true };
        }
        let mut safe = self.text.len().saturating_sub(self.hold).max(self.released);
        while !self.text.is_char_boundary(safe) {
            safe -= 1;
        }
        let out = self.text.get(self.released..safe).unwrap_or_default().to_owned();
        self.released = safe.max(self.released);
        Released { text: out, stopped: false }
    }

    /// Releases what was held back (generation ended without a stop string); a character
    /// left unfinished is not sent (its token ids are, in the stream).
    pub fn finish(&mut self) -> String {
        let out = self.text.get(self.released..).unwrap_or_default().to_owned();
        self.released = self.text.len();
        out
    }

    /// All text released so far.
    pub fn released(&self) -> &str {
        self.text.get(..self.released).unwrap_or(&self.text)
    }
}

/// The bytes `a` and `b` begin with alike, in whole characters.
fn common_prefix(a: &str, b: &str) -> usize {
    a.chars().zip(b.chars()).take_while(|(x, y)| x == y).map(|(x, _)| x.len_utf8()).sum()
}

#[cfg(test)]
mod tests;
