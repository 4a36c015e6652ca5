//! What a prefill instance measures of itself for the schedulers: [`TokenCost`], its compute
//! per token, and [`SendCost`], the time its KV still takes once the compute is done (a slow
//! link), both sent in heartbeats.

use std::time::{Duration, Instant};

/// Prefill compute time per computed token: a token-weighted moving average (each new
/// prefill's weight is its token count, older ones decay by [`TokenCost::DECAY`]), never
/// below the warm-up's solo cost times the engines sharing the compute. A burst is priced
/// by the cost of the moment it arrives; measured alone, that would be the solo cost,
/// however many engines are about to compete for the same cores.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct TokenCost {
    micros: f64,
    tokens: f64,
    /// The warm-up's cost per token, measured with the engine to itself.
    solo_us: f64,
}

impl TokenCost {
    const DECAY: f64 = 0.9;

    /// Adds a prefill of `tokens` computed tokens that took `took`.
    pub(crate) fn add(&mut self, tokens: usize, took: Duration) {
        if tokens == 0 {
            return;
        }
        self.micros = self.micros * Self::DECAY + took.as_secs_f64() * 1e6;
        self.tokens = self.tokens * Self::DECAY + tokens as f64;
    }

    /// Adds the warm-up: a prefill of `tokens` that took `took` with the engine to itself.
    pub(crate) fn add_solo(&mut self, tokens: usize, took: Duration) {
        if tokens > 0 {
            self.solo_us = took.as_secs_f64() * 1e6 / tokens as f64;
        }
        self.add(tokens, took);
    }

    /// Microseconds per token when `shared_by` engines take turns on the compute (0 before
    /// any prefill).
    pub(crate) fn per_token_us(&self, shared_by: usize) -> f64 {
        let measured = if self.tokens > 0.0 { self.micros / self.tokens } else { 0.0 };
        measured.max(self.solo_us * shared_by.max(1) as f64)
    }
}

/// The time a prefill's KV takes after its compute, per prompt token: a moving average like
/// [`TokenCost`]'s, halving for every [`SendCost::HALF_LIFE`] without a new measurement. A
/// prefill priced out of big prompts by a slow link gets few requests to measure with; the
/// decay lets it be tried again, and a link still slow is measured slow again.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SendCost {
    average: TokenCost,
    last: Option<Instant>,
}

impl SendCost {
    /// How long an unrefreshed measurement takes to count half.
    pub(crate) const HALF_LIFE: Duration = Duration::from_secs(30);

    /// Adds a request of `tokens` prompt tokens whose KV took `took` after the compute, at
    /// `now`. What was measured before counts as decayed by then, in value and in weight: one
    /// fast request after a long quiet is not outvoted by the slow ones of long ago.
    pub(crate) fn add_at(&mut self, tokens: usize, took: Duration, now: Instant) {
        if let Some(last) = self.last {
            let f = Self::factor(now.saturating_duration_since(last));
            self.average.micros *= f * f;
            self.average.tokens *= f;
        }
        self.average.add(tokens, took);
        self.last = Some(now);
    }

    /// What a measurement counts for after `idle` without a new one.
    fn factor(idle: Duration) -> f64 {
        0.5f64.powf(idle.as_secs_f64() / Self::HALF_LIFE.as_secs_f64())
    }

    /// Microseconds per prompt token as of `now` (0 before any measurement).
    pub(crate) fn per_token_us_at(&self, now: Instant) -> f64 {
        let Some(last) = self.last else { return 0.0 };
        self.average.per_token_us(1) * Self::factor(now.saturating_duration_since(last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unrefreshed_send_cost_halves_every_half_life() {
        let t0 = Instant::now();
        let mut c = SendCost::default();
        assert_eq!(c.per_token_us_at(t0), 0.0, "nothing measured");
        c.add_at(1000, Duration::from_millis(80), t0); // 80 us per token
        assert!((c.per_token_us_at(t0) - 80.0).abs() < 1e-9);
        let later = |c: &SendCost, d| c.per_token_us_at(t0 + d);
        assert!((later(&c, SendCost::HALF_LIFE) - 40.0).abs() < 1e-9);
        assert!((later(&c, SendCost::HALF_LIFE * 2) - 20.0).abs() < 1e-9);
        c.add_at(1000, Duration::from_millis(80), t0 + SendCost::HALF_LIFE * 2);
        let again = later(&c, SendCost::HALF_LIFE * 2);
        assert!(again > 40.0, "measured slow again, it counts slow again: {again}");
        // Slow for long, then quiet for ten half-lives: one fast request sets the price.
        let mut d = SendCost::default();
        for _ in 0..20 {
            d.add_at(1000, Duration::from_millis(80), t0);
        }
        let healed = t0 + SendCost::HALF_LIFE * 10;
        d.add_at(1000, Duration::from_millis(1), healed);
        let now = d.per_token_us_at(healed);
        assert!(now < 5.0, "the healed link is priced by its probe: {now}");
    }

    #[test]
    fn the_cost_is_the_moving_average_but_never_below_the_solo_cost_times_the_sharers() {
        let ms = Duration::from_millis;
        let mut c = TokenCost::default();
        assert_eq!(c.per_token_us(3), 0.0, "nothing measured");
        c.add_solo(100, ms(100)); // 1 ms per token alone
        assert_eq!(c.per_token_us(1), 1000.0);
        // Three engines on the same cores: priced as if all were busy from the start.
        assert_eq!(c.per_token_us(3), 3000.0);
        // Measured slower than that under load: the measurement wins.
        for _ in 0..50 {
            c.add(100, ms(500));
        }
        assert!(c.per_token_us(3) > 4900.0, "{}", c.per_token_us(3));
        // Measured faster (the others idle): the floor holds.
        for _ in 0..100 {
            c.add(100, ms(100));
        }
        assert!((c.per_token_us(3) - 3000.0).abs() < 1.0, "{}", c.per_token_us(3));
        assert!((c.per_token_us(1) - 1000.0).abs() < 1.0, "{}", c.per_token_us(1));
    }
}
