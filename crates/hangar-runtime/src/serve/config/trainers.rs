//! Trainers: the model Hangar derives from each cog model to run its
//! trainings on GPUs that placement grants.
//!
//! A training runs the model's `train` on a cog server in train mode. Those
//! servers are the replicas of a model of their own, `KEY/trainer`: the
//! same directory in train mode, the model's size, hardware and weights, at
//! most one replica of one permit (a model's trainings run one at a time)
//! and none while no training waits or runs. So placement puts a trainer on
//! a node with room — an agent's, on a fleet — the controller starts one
//! when a training waits and gives its GPU back after a quiet period, as
//! for any model at zero, and starts, health checks, metrics and
//! `/admin/status` are a model's. Clients never see it: the APIs neither
//! list nor serve it.

use hangar_agent::engine::EngineSpec;
use hangar_core::{FieldError, ModelKey};

use super::{ModelConfig, ServeConfig};

/// What a trainer's key adds to its model's.
const SUFFIX: &str = "/trainer";

/// The name `model`'s trainer would have, if `model` has one: a cog
/// model's (not a trainer's own). `None` for any other engine.
fn trainer_name(model: &ModelConfig) -> Option<String> {
    match model.engine {
        EngineSpec::Cog { train: false, .. } => Some(format!("{}{SUFFIX}", model.key)),
        _ => None,
    }
}

/// The key of `model`'s trainer, if `model` has one (and its name is a
/// model key, which validation checks).
pub fn trainer_key(model: &ModelConfig) -> Option<ModelKey> {
    trainer_name(model)?.parse().ok()
}

impl ServeConfig {
    /// Refuses a file in which a cog model's trainer could not have its
    /// key: too long for one, or taken by a model of the file.
    pub(super) fn check_trainer_keys(&self) -> Result<(), FieldError> {
        for (i, m) in self.models.iter().enumerate() {
            let Some(name) = trainer_name(m) else { continue };
            let Ok(key) = name.parse::<ModelKey>() else {
                return Err(FieldError::new(
                    format!("models[{i}].key"),
                    format!(
                        "`{}` is too long for a cog model: its trainer is `KEY{SUFFIX}`, and a model key is at \
                         most 128 bytes",
                        m.key
                    ),
                ));
            };
            let taken = |other: &ModelConfig| other.key == key && other.trains.as_ref() != Some(&m.key);
            if let Some(j) = self.models.iter().position(taken) {
                return Err(FieldError::new(
                    format!("models[{j}].key"),
                    format!(
                        "`{key}` is the key of the trainer of the cog model `{}` (models[{i}]), which runs its \
                         trainings: choose another",
                        m.key
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Adds each cog model's trainer to the models, once (each kind of
    /// server does as it starts, so a configuration made in code has them
    /// too; validation, which [`Self::check_trainer_keys`] is part of,
    /// takes either).
    pub(crate) fn add_trainers(&mut self) {
        let missing = |t: &ModelConfig| !self.models.iter().any(|m| m.key == t.key);
        let trainers: Vec<ModelConfig> = self.models.iter().filter_map(trainer).filter(missing).collect();
        self.models.extend(trainers);
    }
}

/// `model`'s trainer, if it has one.
fn trainer(model: &ModelConfig) -> Option<ModelConfig> {
    let key = trainer_key(model)?;
    let mut engine = model.engine.clone();
    if let EngineSpec::Cog { train, .. } = &mut engine {
        *train = true;
    }
    Some(ModelConfig {
        key,
        engine,
        min_replicas: 0,
        max_replicas: Some(1),
        concurrency: 1,
        slo_ttft_ms: None,
        scaling: None,
        websocket: None,
        adapters: None,
        adapter_access: Vec::new(),
        hotswap: false,
        use_async_queue: false,
        trains: Some(model.key.clone()),
        ..model.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const COG: &str = "[[nodes]]\nid = \"n\"\ngpus = 1\ngpu_memory = \"80GB\"\ngpu_kind = \"a100\"\n\
        [[models]]\nkey = \"acme/echo\"\nengine = { kind = \"cog\", dir = \"echo\" }\nsize = \"10GB\"\n\
        min_replicas = 1\ngpu_kind = \"a100\"\n\
        [[models]]\nkey = \"acme/chat\"\nengine = { kind = \"mock\" }\nsize = \"10GB\"\n";

    #[test]
    fn each_cog_model_gets_a_trainer_of_one_replica_on_its_hardware_started_on_demand() {
        let mut config = ServeConfig::from_toml(COG, "serve.toml").unwrap();
        config.add_trainers();
        config.add_trainers();
        config.validate().unwrap();
        let keys: Vec<&str> = config.models.iter().map(|m| m.key.as_str()).collect();
        assert_eq!(keys, ["acme/echo", "acme/chat", "acme/echo/trainer"]);
        let t = &config.models[2];
        assert_eq!(t.trains.as_ref().map(ModelKey::as_str), Some("acme/echo"));
        assert!(matches!(t.engine, EngineSpec::Cog { train: true, .. }), "{:?}", t.engine);
        assert_eq!((t.min_replicas, t.max_replicas(), t.permits()), (0, 1, 1));
        assert_eq!((t.size, t.gpu_kind.as_deref()), (config.models[0].size, Some("a100")));
        assert!(config.models[..2].iter().all(|m| m.trains.is_none()));
    }

    #[test]
    fn a_trainers_key_is_refused_to_the_models_of_the_file() {
        let taken = format!(
            "{COG}[[models]]\nkey = \"acme/echo/trainer\"\nengine = {{ kind = \"mock\" }}\nsize = \"1GB\"\n"
        );
        let e = ServeConfig::from_toml(&taken, "serve.toml").unwrap_err().to_string();
        assert!(e.contains("models[2].key") && e.contains("trainer of the cog model `acme/echo`"), "{e}");
        let long = COG.replace("acme/echo", &format!("acme/{}", "e".repeat(121)));
        let e = ServeConfig::from_toml(&long, "serve.toml").unwrap_err().to_string();
        assert!(e.contains("models[0].key") && e.contains("too long for a cog model"), "{e}");
    }
}
