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

/// Tokens an unfinished character may wait for its rest through: no UTF-8 character takes
/// more than 4 bytes. Past it the bytes never become one (a model's stray byte tokens); they
/// are given out as U+FFFD, so a run of them is not decoded again at each token.
const MAX_UNFINISHED: usize = 8;

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
        let settled = decode(&self.tokens[self.window..self.read]);
        let now = decode(&self.tokens[self.window..]);
        // Past what the two have in common (all of `settled` but for decoders that tidy
        // spaces by the next token, whose change is already sent).
        let new = &now[common_prefix(&settled, &now)..];
        let waiting = self.tokens.len() - self.read <= MAX_UNFINISHED;
        let complete = if waiting { new.trim_end_matches('\u{FFFD}') } else { new };
        if let Some(more) = complete.get(self.shown..) {
            self.text.push_str(more);
            self.shown = complete.len();
        }
        if complete.len() == new.len() {
            (self.window, self.read, self.shown) = (self.read, self.tokens.len(), 0);
        }
        self.release()
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
