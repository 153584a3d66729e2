//! The suite's cases: each a trace — generated, or a public one mapped
//! onto models — and the fleet file it runs on.

use hangar_core::mix64;

use crate::fleet::FleetConfig;
use crate::synth::{self, Pattern, SynthConfig};
use crate::trace::{Trace, TraceRequest};

use super::SuiteError;

/// One case of the suite.
#[derive(Debug, Clone)]
pub struct Case {
    /// Its name (`--case NAME`).
    pub name: &'static str,
    /// What it is, in a line.
    pub title: &'static str,
    /// The fleet file it runs on.
    pub fleet_file: FleetFile,
    /// Where its trace comes from.
    pub source: Source,
    /// Kept out of any tuning: a policy is judged on it, never fitted to
    /// it (docs/scaling.md).
    pub held_out: bool,
}

/// A fleet file of the repository, compiled in.
#[derive(Debug, Clone, Copy)]
pub struct FleetFile {
    /// Its path in the repository.
    pub path: &'static str,
    toml: &'static str,
}

/// The [`FleetFile`] at `path` from the repository's root.
macro_rules! fleet_file {
    ($path:literal) => {
        FleetFile { path: $path, toml: include_str!(concat!("../../../../", $path)) }
    };
}

/// Where a case's trace comes from.
#[derive(Debug, Clone)]
pub enum Source {
    /// `hangar trace synth` with these settings.
    Synth(SynthConfig),
    /// Azure's 2023 conversation and code traces merged in time order
    /// (conversation first at equal times), the `k`-th row of the merge
    /// (from 0) going to model `azure/m{mix64(k, 0) mod models}`.
    AzureMerged {
        /// How many models.
        models: u32,
    },
    /// Mooncake's conversation trace, each row going to model
    /// `mooncake/m{mix64(id, 1) mod models}`, `id` its second block id
    /// (the first is the one every row shares; the second names the
    /// conversation's opening, so a conversation's turns, which extend
    /// it, stay on one model with their shared prefix), its only one if
    /// it has one, its row index if none.
    Mooncake {
        /// How many models.
        models: u32,
    },
}

/// The public traces a run has (each `None` when not found).
#[derive(Debug, Default)]
pub struct PublicTraces {
    /// `azure2023_conv.csv`.
    pub azure_conv: Option<Trace>,
    /// `azure2023_code.csv`.
    pub azure_code: Option<Trace>,
    /// `mooncake_conversation_trace.jsonl`.
    pub mooncake: Option<Trace>,
}

/// The files `--traces-dir` looks for, as /work/shared/traces and their
/// sources name them.
pub const AZURE_CONV: &str = "azure2023_conv.csv";
/// See [`AZURE_CONV`].
pub const AZURE_CODE: &str = "azure2023_code.csv";
/// See [`AZURE_CONV`].
pub const MOONCAKE: &str = "mooncake_conversation_trace.jsonl";

fn synth(requests: u32, rate: f64, models: u32, pattern: Pattern, period_s: f64, seed: u64) -> SynthConfig {
    SynthConfig { requests, rate, models, pattern, period_s, max_turns: 1, seed, ..SynthConfig::default() }
}

/// Every case, in the order the table shows them. Synthetic traces take
/// `seed_offset` added to their seed (a fresh draw of the same shapes,
/// for a check on traces no one tuned on) and `scale` of their requests
/// at the same rates (shorter; 1 for the suite as documented).
pub fn cases(seed_offset: u64, scale: f64) -> Vec<Case> {
    let n = |requests: u32| ((f64::from(requests) * scale).round() as u32).max(1);
    let small = SynthConfig {
        system_prompt_tokens: 512,
        user_tokens_mean: 128.0,
        output_tokens_mean: 32.0,
        ..synth(n(5400), 1.5, 1, Pattern::Steady, 600.0, 3 + seed_offset)
    };
    vec![
        Case {
            name: "azure",
            title: "Azure 2023 conversation and code traces merged, 4 models by a hash of the row index",
            fleet_file: fleet_file!("examples/suite/azure.toml"),
            source: Source::AzureMerged { models: 4 },
            held_out: false,
        },
        Case {
            name: "mooncake",
            title: "Mooncake conversation trace, 4 models by a hash of each prompt's opening block",
            fleet_file: fleet_file!("examples/suite/mooncake.toml"),
            source: Source::Mooncake { models: 4 },
            held_out: true,
        },
        Case {
            name: "steady",
            title: "one model, Poisson arrivals at 4.5 requests/s for an hour",
            fleet_file: fleet_file!("examples/suite/steady.toml"),
            source: Source::Synth(synth(n(16_200), 4.5, 1, Pattern::Steady, 600.0, 1 + seed_offset)),
            held_out: false,
        },
        Case {
            name: "diurnal",
            title: "4 models, load a sine between 10 % and 190 % of 4 requests/s over 30 minutes",
            fleet_file: fleet_file!("examples/suite/diurnal.toml"),
            source: Source::Synth(synth(n(24_000), 4.0, 4, Pattern::Diurnal, 1800.0, 2 + seed_offset)),
            held_out: true,
        },
        Case {
            name: "bursty",
            title: "docs/sim.md's bursty 4-model trace: a tenth of every 2 minutes at 5× the rate",
            fleet_file: fleet_file!("examples/fleet.toml"),
            source: Source::Synth(synth(n(3000), 5.0, 4, Pattern::Bursty, 120.0, seed_offset)),
            held_out: false,
        },
        Case {
            name: "long-load",
            title: "a 70 GB model loading 150 s from a slow disk, 1.5 short requests/s for an hour",
            fleet_file: fleet_file!("examples/suite/long-load.toml"),
            source: Source::Synth(small),
            held_out: false,
        },
        Case {
            name: "contention",
            title: "3 models of a whole GPU each on 2 GPUs, bursts every 10 minutes",
            fleet_file: fleet_file!("examples/suite/contention.toml"),
            source: Source::Synth(synth(n(7200), 2.0, 3, Pattern::Bursty, 600.0, 5 + seed_offset)),
            held_out: false,
        },
    ]
}

impl Case {
    /// Its fleet, as the file in the repository says.
    pub fn fleet(&self) -> FleetConfig {
        FleetConfig::parse(self.fleet_file.toml, self.fleet_file.path)
            .expect("the suite's fleet files are checked by its tests")
    }

    /// Where its trace comes from, as a user would make or find it.
    pub fn describe(&self) -> String {
        match &self.source {
            Source::Synth(c) => format!(
                "hangar trace synth --requests {} --rate {} --models {} --pattern {} --period-s {} --max-turns 1{} --seed {}",
                c.requests,
                c.rate,
                c.models,
                match c.pattern {
                    Pattern::Steady => "steady",
                    Pattern::Diurnal => "diurnal",
                    Pattern::Bursty => "bursty",
                },
                c.period_s,
                if c.output_tokens_mean == SynthConfig::default().output_tokens_mean {
                    String::new()
                } else {
                    format!(
                        " --system-prompt-tokens {} --user-tokens {} --output-tokens {}",
                        c.system_prompt_tokens, c.user_tokens_mean, c.output_tokens_mean
                    )
                },
                c.seed,
            ),
            Source::AzureMerged { models } => {
                format!("{AZURE_CONV} + {AZURE_CODE} merged, row k → azure/m{{mix64(k, 0) mod {models}}}")
            }
            Source::Mooncake { models } => {
                format!("{MOONCAKE}, row → mooncake/m{{mix64(its second block id, 1) mod {models}}}")
            }
        }
    }

    /// The public traces it needs that `public` lacks, by file name.
    pub fn missing(&self, public: &PublicTraces) -> Vec<&'static str> {
        match &self.source {
            Source::Synth(_) => Vec::new(),
            Source::AzureMerged { .. } => {
                [(AZURE_CONV, &public.azure_conv), (AZURE_CODE, &public.azure_code)]
                    .into_iter()
                    .filter(|(_, t)| t.is_none())
                    .map(|(name, _)| name)
                    .collect()
            }
            Source::Mooncake { .. } => {
                if public.mooncake.is_none() {
                    vec![MOONCAKE]
                } else {
                    Vec::new()
                }
            }
        }
    }

    /// Its trace; a public one cut to the first `scale` of its span.
    /// `None` when a public trace it needs is missing.
    pub fn trace(&self, public: &PublicTraces, scale: f64) -> Result<Option<Trace>, SuiteError> {
        let trace = match &self.source {
            Source::Synth(config) => {
                return synth::trace(config, &format!("{}.jsonl", self.name))
                    .map(Some)
                    .map_err(|e| SuiteError::Trace { case: self.name, why: e.to_string() });
            }
            Source::AzureMerged { models } => match (&public.azure_conv, &public.azure_code) {
                (Some(conv), Some(code)) => merge_by_row_hash(&[conv, code], "azure", *models),
                _ => return Ok(None),
            },
            Source::Mooncake { models } => match &public.mooncake {
                Some(t) => by_prefix_hash(t, "mooncake", *models),
                None => return Ok(None),
            },
        };
        Ok(Some(first_share(trace, scale)))
    }
}

/// `parts` merged in time order (a stable sort: at equal times, earlier
/// parts first, each in its file order), the `k`-th row going to
/// `{prefix}/m{mix64(k, 0) mod models}`.
pub fn merge_by_row_hash(parts: &[&Trace], prefix: &str, models: u32) -> Trace {
    let mut requests: Vec<TraceRequest> = parts.iter().flat_map(|t| t.requests.iter().cloned()).collect();
    requests.sort_by(|a, b| a.timestamp_ms.total_cmp(&b.timestamp_ms));
    for (k, r) in requests.iter_mut().enumerate() {
        r.model = Some(format!("{prefix}/m{}", mix64(k as u64, 0) % u64::from(models.max(1))));
        r.session = None;
    }
    let source = parts.iter().map(|t| t.source.as_str()).collect::<Vec<_>>().join(" + ");
    Trace { source, requests, sessions: 0 }
}

/// Each row of `trace` to `{prefix}/m{mix64(id, 1) mod models}`, `id` its
/// second block id, its only one, or its row index.
pub fn by_prefix_hash(trace: &Trace, prefix: &str, models: u32) -> Trace {
    let requests = (trace.requests.iter().enumerate())
        .map(|(k, r)| {
            let id = r.hash_ids.get(1).or(r.hash_ids.first()).copied().unwrap_or(k as u64);
            TraceRequest {
                model: Some(format!("{prefix}/m{}", mix64(id, 1) % u64::from(models.max(1)))),
                session: None,
                ..r.clone()
            }
        })
        .collect();
    Trace { source: trace.source.clone(), requests, sessions: 0 }
}

/// The rows of the first `share` of the trace's span (all at 1).
fn first_share(mut trace: Trace, share: f64) -> Trace {
    if share >= 1.0 {
        return trace;
    }
    let (lo, hi) = trace.requests.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), r| {
        (lo.min(r.timestamp_ms), hi.max(r.timestamp_ms))
    });
    let until = lo + (hi - lo) * share;
    trace.requests.retain(|r| r.timestamp_ms <= until);
    trace
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fleet_file_parses_and_serves_its_traces_models() {
        for case in cases(0, 0.01) {
            let fleet = case.fleet();
            if let Source::Synth(_) = case.source {
                let trace = case.trace(&PublicTraces::default(), 1.0).unwrap().unwrap();
                for r in &trace.requests {
                    let model = r.model.as_deref().unwrap_or("synth/m0");
                    assert!(fleet.models.iter().any(|m| m.key.as_str() == model), "{}: {model}", case.name);
                }
            }
        }
    }

    #[test]
    fn public_cases_wait_for_their_files_and_map_rows_by_their_rule() {
        let azure = &cases(0, 1.0)[0];
        assert_eq!(azure.missing(&PublicTraces::default()), vec![AZURE_CONV, AZURE_CODE]);
        assert!(azure.trace(&PublicTraces::default(), 1.0).unwrap().is_none());
        let conv = crate::trace::read(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,10,3\n2023-11-16 18:15:48.0,12,4\n",
            "conv.csv",
        )
        .unwrap();
        let code = crate::trace::read(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.0,20,5\n",
            "code.csv",
        )
        .unwrap();
        let public = PublicTraces { azure_conv: Some(conv), azure_code: Some(code), mooncake: None };
        let merged = azure.trace(&public, 1.0).unwrap().unwrap();
        let lens: Vec<u32> = merged.requests.iter().map(|r| r.input_len).collect();
        assert_eq!(lens, [10, 20, 12], "time order");
        for (k, r) in merged.requests.iter().enumerate() {
            assert_eq!(r.model.clone().unwrap(), format!("azure/m{}", mix64(k as u64, 0) % 4));
        }
        // A conversation's turns extend its opening: one model for all.
        let mooncake = crate::trace::read(
            "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [0, 7]}\n\
             {\"timestamp\": 5, \"input_length\": 2048, \"output_length\": 1, \"hash_ids\": [0, 7, 8, 9]}\n\
             {\"timestamp\": 9, \"input_length\": 10, \"output_length\": 1}\n",
            "mc.jsonl",
        )
        .unwrap();
        let mapped = by_prefix_hash(&mooncake, "mooncake", 4);
        assert_eq!(mapped.requests[0].model, mapped.requests[1].model);
        assert_eq!(mapped.requests[2].model.clone().unwrap(), format!("mooncake/m{}", mix64(2, 1) % 4));
    }

    #[test]
    fn a_scaled_suite_is_shorter_at_the_same_rates() {
        let full = cases(0, 1.0);
        let small = cases(0, 0.1);
        let Source::Synth(a) = &full[2].source else { panic!() };
        let Source::Synth(b) = &small[2].source else { panic!() };
        assert_eq!((a.requests, b.requests, a.rate), (16_200, 1620, b.rate));
        assert_eq!(cases(1, 1.0)[2].describe().split("--seed ").nth(1), Some("2"));
    }
}
