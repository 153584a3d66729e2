//! A model's `[models.scaling]` table: which policy, and its knobs, each
//! with its source's default.

use hangar_core::{FieldError, Millis};
use serde::{Deserialize, Serialize};

/// The scaling policy of one model and its settings.
///
/// ```toml
/// [models.scaling]
/// policy = "replicate"          # or "workers-ai", "hangar" (default), "fixed"
/// scale_in_window_s = 120
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "kebab-case")]
pub enum ScalingConfig {
    /// Replicate's backlog-per-instance HPA (seed 001).
    Replicate(ReplicateSettings),
    /// Workers AI's EZ utilization loop (seed 001).
    WorkersAi(WorkersAiSettings),
    /// Hangar's own: demand-sized, cold-start-aware, no reversal under
    /// steady load.
    Hangar(HangarSettings),
    /// Exactly `min_replicas`, whatever the load.
    Fixed,
}

impl Default for ScalingConfig {
    fn default() -> Self {
        ScalingConfig::Hangar(HangarSettings::default())
    }
}

impl ScalingConfig {
    /// The policy's name, as the config spells it.
    pub fn name(&self) -> &'static str {
        match self {
            ScalingConfig::Replicate(_) => "replicate",
            ScalingConfig::WorkersAi(_) => "workers-ai",
            ScalingConfig::Hangar(_) => "hangar",
            ScalingConfig::Fixed => "fixed",
        }
    }

    /// Checks that the policy can run a model within `bounds`: `fixed`
    /// keeps exactly `min_replicas`, so with 0 the model would never run
    /// (every other policy starts a model at zero when a request waits).
    /// The path names the model's `min_replicas`.
    pub fn check_bounds(&self, bounds: crate::Bounds) -> Result<(), FieldError> {
        match self {
            ScalingConfig::Fixed if bounds.min == 0 => Err(FieldError::new(
                "min_replicas",
                "is 0, and the `fixed` policy keeps exactly min_replicas replicas, so the model would never run: \
                 set min_replicas to the count to keep, or choose a policy that scales (hangar, replicate, workers-ai)",
            )),
            _ => Ok(()),
        }
    }

    /// Checks every knob's range; paths are relative to the table.
    pub fn validate(&self) -> Result<(), FieldError> {
        match self {
            ScalingConfig::Replicate(s) => s.validate(),
            ScalingConfig::WorkersAi(s) => s.validate(),
            ScalingConfig::Hangar(s) => s.validate(),
            ScalingConfig::Fixed => Ok(()),
        }
    }
}

/// The longest window or delay any knob may hold: 30 days.
const MAX_S: u64 = 30 * 24 * 3600;

fn seconds(field: &str, v: u64, min: u64) -> Result<(), FieldError> {
    match (min..=MAX_S).contains(&v) {
        true => Ok(()),
        false => Err(FieldError::new(field, format!("{v} is out of range: {min} to {MAX_S} seconds"))),
    }
}

fn fraction(field: &str, v: f64, low: f64, high: f64) -> Result<(), FieldError> {
    match v.is_finite() && v >= low && v <= high {
        true => Ok(()),
        false => Err(FieldError::new(field, format!("{v} is out of range: {low} to {high}"))),
    }
}

/// Replicate's autoscaler (`computeNewReplicaCountV2`, seed 001): desired
/// = current × backlog-per-instance / target, damped by scaling policies,
/// stabilization windows and hysteresis.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicateSettings {
    /// Backlog (waiting + running requests + `queue_headroom`) per replica
    /// the scaler aims at. Seed 001: a CLI flag, no default given; here
    /// the model's `concurrency` (a replica is on target with every permit
    /// busy and nobody waiting).
    pub target_backlog_per_replica: Option<f64>,
    /// Added to the backlog (seed 001's `queueHeadroom`). Default 0.
    pub queue_headroom: u32,
    /// Milliseconds between decisions. Seed 001: the scaler runs every 1 s.
    pub interval_ms: Millis,
    /// Scale-out stabilization: the lowest recommendation of this window
    /// is used. Seed 001: 30 s.
    pub scale_out_window_s: u64,
    /// Scale-in stabilization: the highest recommendation of this window is
    /// used. Seed 001: 2 min.
    pub scale_in_window_s: u64,
    /// Scale-out policy: at most this many replicas more per period…
    /// Seed 001: +5…
    pub scale_out_step: u32,
    /// …or this many percent more, whichever is larger. Seed 001: +100 %…
    pub scale_out_percent: u32,
    /// …per this period. Seed 001: per minute.
    pub scale_out_period_s: u64,
    /// Ratios of metric to target within this of 1 change nothing. Seed
    /// 001: 0.02.
    pub hysteresis: f64,
    /// Until a first replica is ready, at most this many. Seed 001: 5.
    pub slow_start_cap: u32,
    /// Seconds without a request before the last replica goes (when
    /// `min_replicas` is 0). Seed 001: configurable, no default given;
    /// here 300, Hangar's quiet period.
    pub scale_to_zero_delay_s: u64,
    /// Emergency cap below `max_replicas` (seed 001's `cap-max-replicas`
    /// flag). Default none.
    pub cap_max_replicas: Option<u32>,
}

impl Default for ReplicateSettings {
    fn default() -> Self {
        ReplicateSettings {
            target_backlog_per_replica: None,
            queue_headroom: 0,
            interval_ms: 1_000,
            scale_out_window_s: 30,
            scale_in_window_s: 120,
            scale_out_step: 5,
            scale_out_percent: 100,
            scale_out_period_s: 60,
            hysteresis: 0.02,
            slow_start_cap: 5,
            scale_to_zero_delay_s: 300,
            cap_max_replicas: None,
        }
    }
}

impl ReplicateSettings {
    fn validate(&self) -> Result<(), FieldError> {
        if let Some(t) = self.target_backlog_per_replica {
            if !(t.is_finite() && t > 0.0) {
                return Err(FieldError::new("target_backlog_per_replica", format!("{t} must be above 0")));
            }
        }
        if !(100..=3_600_000).contains(&self.interval_ms) {
            return Err(FieldError::new("interval_ms", "must be 100 ms to 1 hour"));
        }
        seconds("scale_out_window_s", self.scale_out_window_s, 0)?;
        seconds("scale_in_window_s", self.scale_in_window_s, 0)?;
        seconds("scale_out_period_s", self.scale_out_period_s, 1)?;
        seconds("scale_to_zero_delay_s", self.scale_to_zero_delay_s, 0)?;
        fraction("hysteresis", self.hysteresis, 0.0, 1.0)?;
        if self.scale_out_step == 0 && self.scale_out_percent == 0 {
            return Err(FieldError::new(
                "scale_out_step",
                "and scale_out_percent are both 0: it could never grow",
            ));
        }
        if self.slow_start_cap == 0 {
            return Err(FieldError::new("slow_start_cap", "must be at least 1"));
        }
        if self.cap_max_replicas == Some(0) {
            return Err(FieldError::new(
                "cap_max_replicas",
                "must be at least 1 (use `fixed` to hold a model at 0)",
            ));
        }
        Ok(())
    }
}

/// Workers AI's EZ utilization-based autoscaler (seed 001): utilization
/// from inference time over a window, a min/max deadband, out-of-capacity
/// inflation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkersAiSettings {
    /// Seconds between decisions. Seed 001: every 5 minutes.
    pub interval_s: u64,
    /// Seconds of history utilization is measured over. Seed 001: 15-minute
    /// windows.
    pub window_s: u64,
    /// Below this utilization, scale down. Seed 001: 0.3.
    pub min_utilization: f64,
    /// Above this utilization, scale up. Seed 001: 0.8.
    pub max_utilization: f64,
    /// Measured utilization is multiplied by this. Seed 001: 1.0.
    pub utilization_scale: f64,
    /// Inflate utilization by `(successful + out_of_capacity) /
    /// successful` (successful floored at 0.1 per minute). Seed 001: true.
    pub use_out_of_cap: bool,
    /// The inflated utilization is capped at this multiple of the measured
    /// one. Seed 001: 2×.
    pub out_of_cap_max_inflation: f64,
    /// At most this many replicas fewer per cycle. Seed 001: 10.
    pub max_downscale_per_cycle: u32,
    /// The kill switch: keep the current count. Seed 001:
    /// `scaling_config.disabled`, default false.
    pub disabled: bool,
    /// Which of Workers AI's three algorithms sizes the model. Seed 001:
    /// the request count is the fallback, the EZ utilization one overrides
    /// it when configured, the older utilization one overrides both; here
    /// one is chosen. Default `ez-utilization`.
    pub algorithm: WorkersAiAlgorithm,
    /// The autoscaling factor: `request-count` wants the requests of a
    /// minute × this (each request taken to last about a minute);
    /// `utilization` clamps it to at least 1.2 and scales up above
    /// utilization 1/f, down below 1/(f + 0.15). Seed 001: 0.8.
    pub scaling_factor: f64,
    /// Size on the larger of the window's work and the work of the same
    /// window `forecast_offset_s` earlier (the utilization algorithms).
    /// Seed 001: true.
    pub use_forecast: bool,
    /// How far back the forecast looks. Seed 001: the same time last week,
    /// 604,800 s.
    pub forecast_offset_s: u64,
}

/// Workers AI's scaling algorithms (seed 001, "Scaling algorithms").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkersAiAlgorithm {
    /// The EZ utilization algorithm: utilization against the
    /// `min_utilization`–`max_utilization` deadband, scaled, inflated by
    /// requests turned away.
    EzUtilization,
    /// The older utilization algorithm (`model_utilization_autoscaler`): a
    /// deadband of 1/(f + 0.15) to 1/f around the factor f.
    Utilization,
    /// The request-count fallback: requests per minute × the factor.
    RequestCount,
}

impl Default for WorkersAiSettings {
    fn default() -> Self {
        WorkersAiSettings {
            interval_s: 300,
            window_s: 900,
            min_utilization: 0.3,
            max_utilization: 0.8,
            utilization_scale: 1.0,
            use_out_of_cap: true,
            out_of_cap_max_inflation: 2.0,
            max_downscale_per_cycle: 10,
            disabled: false,
            algorithm: WorkersAiAlgorithm::EzUtilization,
            scaling_factor: 0.8,
            use_forecast: true,
            forecast_offset_s: 7 * 24 * 3600,
        }
    }
}

impl WorkersAiSettings {
    fn validate(&self) -> Result<(), FieldError> {
        seconds("interval_s", self.interval_s, 1)?;
        seconds("window_s", self.window_s, 1)?;
        fraction("min_utilization", self.min_utilization, 0.0, 1.0)?;
        fraction("max_utilization", self.max_utilization, 0.0, 1.0)?;
        if self.max_utilization <= self.min_utilization {
            return Err(FieldError::new(
                "max_utilization",
                format!(
                    "{} must be above min_utilization ({}): the deadband is empty",
                    self.max_utilization, self.min_utilization
                ),
            ));
        }
        fraction("utilization_scale", self.utilization_scale, 0.01, 100.0)?;
        fraction("out_of_cap_max_inflation", self.out_of_cap_max_inflation, 1.0, 100.0)?;
        if self.max_downscale_per_cycle == 0 {
            return Err(FieldError::new("max_downscale_per_cycle", "must be at least 1"));
        }
        fraction("scaling_factor", self.scaling_factor, 0.01, 100.0)?;
        seconds("forecast_offset_s", self.forecast_offset_s, 1)?;
        Ok(())
    }

    /// The older utilization algorithm's factor: `scaling_factor`, at least
    /// 1.2 (seed 001: a 20 % over-provisioning floor).
    pub(crate) fn utilization_factor(&self) -> f64 {
        self.scaling_factor.max(1.2)
    }

    /// The utilization a resized model is sized for: the middle of the
    /// deadband, so neither edge is crossed again at once.
    pub(crate) fn aim(&self) -> f64 {
        (self.min_utilization + self.max_utilization) / 2.0
    }
}

/// Hangar's policy: as many replicas as the demand needs — measured from
/// arrivals and permit times, beyond the noise of Poisson traffic —
/// counting replicas still loading as capacity on the way; up at once on a
/// burst or a rate surely above the count, down only after a quiet period
/// in which the demand surely fitted fewer (docs/scaling.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HangarSettings {
    /// Milliseconds between decisions. Default 1000.
    pub interval_ms: Millis,
    /// Share of a replica's permits the sizing aims to fill (1.0: a
    /// replica per `concurrency` requests running or waiting). Default 1.0.
    pub target_occupancy: f64,
    /// The longest quiet period, in seconds: the demand must stay below
    /// the replicas this long before any is given back (the period's peak
    /// is kept), until the model's restart time has been measured. It is
    /// also the stabilization window: under steady load no decision
    /// reverses another within it. 0: never give one back. Default 300
    /// (the quiet period Hangar always had).
    pub scale_down_after_s: u64,
    /// Once restarts have been measured, the quiet period is this many
    /// times the mean restart (WARM wake and COLD start, weighted by how
    /// often each happened), within `min_quiet_s` and
    /// `scale_down_after_s`: a replica that comes back in a second is
    /// given back soon, one that takes a minute to load is kept longer (the
    /// ski-rental rule: idle no longer than a multiple of what coming back
    /// costs). Default 2.
    pub quiet_factor: f64,
    /// The shortest quiet period, in seconds (at most `scale_down_after_s`).
    /// Default 5.
    pub min_quiet_s: u64,
    /// How long, in seconds, an idle replica given back stays WARM
    /// (asleep, its weights in CPU memory) before it is let go. Unset (the
    /// default): for as long as its node's warm cache has room — placement
    /// drops WARM copies only to make room for another, the smallest (the
    /// cheapest to load again) first — so a model back after half an hour
    /// wakes in seconds instead of loading from disk.
    pub warm_keep_s: Option<u64>,
    /// How far, in standard deviations of Poisson noise, a change of the
    /// demand must go before the count follows it: the arrival rate's
    /// confidence bounds (rate ± `noise_z` × √count) decide a step up on
    /// a measured rate and a give-back, and a queue counts as a burst only
    /// beyond the same band around the demand. Steady traffic so keeps one
    /// count however it fluctuates. Default 3.
    pub noise_z: f64,
    /// The window, in seconds, over which the arrival rate is measured
    /// for a give-back (at least; the quiet period when longer); a step up
    /// on the rate measures over a third of it. Default 60.
    pub rate_window_s: u64,
}

impl Default for HangarSettings {
    fn default() -> Self {
        HangarSettings {
            interval_ms: 1_000,
            target_occupancy: 1.0,
            scale_down_after_s: 300,
            quiet_factor: 2.0,
            min_quiet_s: 5,
            warm_keep_s: None,
            noise_z: 3.0,
            rate_window_s: 60,
        }
    }
}

impl HangarSettings {
    fn validate(&self) -> Result<(), FieldError> {
        if !(100..=3_600_000).contains(&self.interval_ms) {
            return Err(FieldError::new("interval_ms", "must be 100 ms to 1 hour"));
        }
        fraction("target_occupancy", self.target_occupancy, 0.05, 1.0)?;
        seconds("scale_down_after_s", self.scale_down_after_s, 0)?;
        seconds("min_quiet_s", self.min_quiet_s, 0)?;
        fraction("quiet_factor", self.quiet_factor, 0.0, 10_000.0)?;
        if let Some(keep) = self.warm_keep_s {
            seconds("warm_keep_s", keep, 0)?;
        }
        fraction("noise_z", self.noise_z, 0.0, 10.0)?;
        if !(3..=3_600).contains(&self.rate_window_s) {
            return Err(FieldError::new("rate_window_s", "must be 3 s to 1 hour"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Model {
        #[serde(default)]
        scaling: ScalingConfig,
    }

    fn parse(text: &str) -> Result<ScalingConfig, String> {
        toml::from_str::<Model>(text).map(|m| m.scaling).map_err(|e| e.to_string())
    }

    #[test]
    fn each_policy_parses_by_name_with_the_seed_defaults() {
        assert_eq!(parse("").unwrap(), ScalingConfig::Hangar(HangarSettings::default()));
        let r = parse("[scaling]\npolicy = \"replicate\"\nscale_in_window_s = 60\n").unwrap();
        let ScalingConfig::Replicate(s) = r else { panic!("{r:?}") };
        assert_eq!(
            (s.scale_in_window_s, s.scale_out_window_s, s.hysteresis, s.slow_start_cap),
            (60, 30, 0.02, 5)
        );
        let w = parse("[scaling]\npolicy = \"workers-ai\"\n").unwrap();
        assert_eq!(w, ScalingConfig::WorkersAi(WorkersAiSettings::default()));
        assert_eq!(parse("[scaling]\npolicy = \"fixed\"\n").unwrap(), ScalingConfig::Fixed);
    }

    #[test]
    fn unknown_policies_and_knobs_are_errors_naming_them() {
        let e = parse("[scaling]\npolicy = \"magic\"\n").unwrap_err();
        assert!(e.contains("magic") && e.contains("workers-ai"), "{e}");
        let e = parse("[scaling]\npolicy = \"replicate\"\nhysterisis = 0.1\n").unwrap_err();
        assert!(e.contains("hysterisis"), "{e}");
    }

    #[test]
    fn out_of_range_knobs_are_refused_by_name() {
        let bad = |text: &str| parse(text).unwrap().validate().unwrap_err().field;
        assert_eq!(bad("[scaling]\npolicy = \"workers-ai\"\nmin_utilization = 0.9\n"), "max_utilization");
        assert_eq!(bad("[scaling]\npolicy = \"replicate\"\nhysteresis = 2.0\n"), "hysteresis");
        assert_eq!(
            bad("[scaling]\npolicy = \"replicate\"\ntarget_backlog_per_replica = 0.0\n"),
            "target_backlog_per_replica"
        );
        assert_eq!(
            bad("[scaling]\npolicy = \"hangar\"\nscale_down_after_s = 99999999999\n"),
            "scale_down_after_s"
        );
        ScalingConfig::default().validate().unwrap();
    }
}
