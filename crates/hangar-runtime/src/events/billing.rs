//! A model's prices: Replicate's (per second of its hardware, per token,
//! per image) and Workers AI's neurons (`cost_per_infer` + Σ coefficient ×
//! metric), both computed for every event.

use serde::{Deserialize, Serialize};

/// `[models.billing]`: how the model's usage is counted and priced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BillingConfig {
    /// Take the engine's `usage` token counts (Replicate's trust flag).
    /// `false`: always estimate them as words × 4/3. Default `true`: the
    /// engines are the operator's own.
    pub trust_usage: bool,
    /// USD per second of inference (permit to end): the price of the
    /// model's hardware.
    pub per_second: f64,
    /// USD per input token.
    pub per_input_token: f64,
    /// USD per output token.
    pub per_output_token: f64,
    /// USD per image produced.
    pub per_image: f64,
    /// Workers AI's neurons; none: every event costs 0 neurons.
    pub neurons: Option<Neurons>,
}

impl Default for BillingConfig {
    fn default() -> Self {
        BillingConfig {
            trust_usage: true,
            per_second: 0.0,
            per_input_token: 0.0,
            per_output_token: 0.0,
            per_image: 0.0,
            neurons: None,
        }
    }
}

/// `[models.billing.neurons]`: neurons = `cost_per_infer` + Σ
/// coefficient × metric, over the metrics named here.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Neurons {
    /// Flat neurons per request.
    pub cost_per_infer: f64,
    /// Neurons per input token.
    pub input_tokens: f64,
    /// Neurons per output token.
    pub output_tokens: f64,
    /// Neurons per image.
    pub images: f64,
    /// Neurons per second of inference.
    pub seconds: f64,
}

/// What one event costs.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Cost {
    /// Replicate-style price, USD.
    pub usd: f64,
    /// Workers AI neurons.
    pub neurons: f64,
}

impl std::ops::AddAssign for Cost {
    fn add_assign(&mut self, other: Cost) {
        self.usd += other.usd;
        self.neurons += other.neurons;
    }
}

impl BillingConfig {
    /// The cost of `inference_ms` of the model's hardware producing these
    /// tokens and images.
    pub fn cost(&self, inference_ms: u64, input_tokens: u64, output_tokens: u64, images: u64) -> Cost {
        let seconds = inference_ms as f64 / 1000.0;
        let (input, output, images) = (input_tokens as f64, output_tokens as f64, images as f64);
        let usd = self.per_second * seconds
            + self.per_input_token * input
            + self.per_output_token * output
            + self.per_image * images;
        let neurons = self.neurons.map_or(0.0, |n| {
            n.cost_per_infer
                + n.input_tokens * input
                + n.output_tokens * output
                + n.images * images
                + n.seconds * seconds
        });
        Cost { usd, neurons }
    }

    /// Every price and coefficient with its field name, for validation.
    pub fn rates(&self) -> impl Iterator<Item = (&'static str, f64)> {
        let n = self.neurons.unwrap_or_default();
        [
            ("per_second", self.per_second),
            ("per_input_token", self.per_input_token),
            ("per_output_token", self.per_output_token),
            ("per_image", self.per_image),
            ("neurons.cost_per_infer", n.cost_per_infer),
            ("neurons.input_tokens", n.input_tokens),
            ("neurons.output_tokens", n.output_tokens),
            ("neurons.images", n.images),
            ("neurons.seconds", n.seconds),
        ]
        .into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worked_example_of_the_docs() {
        // 2.5 s on a $0.001400/s GPU, 120 tokens in, 380 out; neurons as
        // Workers AI's infire LLMs count them.
        let billing = BillingConfig {
            per_second: 0.0014,
            per_input_token: 0.000_000_5,
            per_output_token: 0.000_001_5,
            neurons: Some(Neurons {
                cost_per_infer: 1.0,
                input_tokens: 0.02561,
                output_tokens: 0.07515,
                ..Neurons::default()
            }),
            ..BillingConfig::default()
        };
        let cost = billing.cost(2_500, 120, 380, 0);
        assert!((cost.usd - (0.0035 + 0.00006 + 0.00057)).abs() < 1e-12, "{cost:?}");
        assert!((cost.neurons - (1.0 + 3.0732 + 28.557)).abs() < 1e-9, "{cost:?}");
        assert_eq!(BillingConfig::default().cost(2_500, 120, 380, 3), Cost::default());
    }
}
