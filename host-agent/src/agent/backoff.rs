//! Capped exponential backoff with full jitter, for every retry of the
//! agent's broker session: reconnecting, re-consuming, publishing again.

use std::time::Duration;

use rand::Rng;

/// Capped exponential backoff with full jitter: each wait is uniform in
/// `0..=cap`, the cap doubling per failure from `min` up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    cap: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Backoff { min, max, cap: min }
    }

    pub fn next_delay(&mut self) -> Duration {
        let cap = self.cap;
        self.cap = (self.cap * 2).min(self.max);
        let secs = rand::rng().random_range(0.0..=cap.as_secs_f64());
        Duration::from_secs_f64(secs).max(Duration::from_millis(10))
    }

    pub fn reset(&mut self) {
        self.cap = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_capped_and_jittered() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800));
        for _ in 0..20 {
            assert!(b.next_delay() <= Duration::from_millis(800));
        }
        assert_eq!(b.cap, Duration::from_millis(800));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
