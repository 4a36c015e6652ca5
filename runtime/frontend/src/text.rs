//! Turning generated tokens into streamed text: byte-level tokenizers can split a character
//! across tokens, and a stop string can span tokens, so text is released only once it is
//! complete and cannot be the start of a stop string; a matched stop string is never sent.

use handoff_engine::Engine;

/// Accumulates tokens and releases text.
#[derive(Debug, Default)]
pub struct TextAssembler {
    tokens: Vec<u32>,
    text: String,
    released: usize,
    stops: Vec<String>,
    hold: usize,
}

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
        self.tokens.push(token);
        self.release(engine.detokenize(&self.tokens))
    }

    /// Takes `full`, the text of every token so far; returns the text it releases.
    fn release(&mut self, full: String) -> Released {
        // An unfinished character decodes as U+FFFD at the end: wait for the next token.
        let complete = full.trim_end_matches('\u{FFFD}');
        if complete.len() >= self.text.len() && complete.starts_with(self.text.as_str()) {
            self.text = complete.to_owned();
        } else if !full.ends_with('\u{FFFD}') {
            self.text = full;
        }
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

    /// Releases what was held back (generation ended without a stop string).
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

#[cfg(test)]
mod tests;
