//! Hangar's mock LLM engine core.
//!
//! [`EngineCore`] is a deterministic, sans-IO model of an LLM inference
//! engine's scheduler: requests go in with [`EngineCore::add_request`]; each
//! [`EngineCore::step`] schedules one forward pass — which requests compute
//! how many tokens, who is admitted or preempted, which KV blocks are cached
//! or evicted — and returns when the pass ends according to the
//! [`timing`] model, with the tokens it emitted. The engine never reads a
//! clock: the live mock server steps it in real time, the simulator on a
//! logical clock, and both get identical decisions.
//!
//! Two schedulers sit behind it ([`SchedulerKind`]): vLLM v1's (paged blocks
//! with a hash-chained prefix cache, chunked prefill, LIFO preemption with
//! recompute) and SGLang's (radix cache, FIFO or longest-prefix-match,
//! decode retraction).
//!
//! ```
//! use hangar_core::RequestId;
//! use hangar_engine::{EngineConfig, EngineCore, EngineRequest, Pass, Prompt};
//!
//! let config = EngineConfig::default();
//! let mut engine = EngineCore::new(&config, |_| unreachable!("no timing table")).unwrap();
//! let prompt = Prompt::from_tokens(&[1, 2, 3, 4], config.block_size);
//! engine.add_request(EngineRequest { id: RequestId(1), prompt, max_output_tokens: 3 }).unwrap();
//! let (mut now, mut pass, mut tokens) = (0.0, Pass::default(), 0);
//! while engine.has_work() {
//!     engine.step(now, &mut pass);
//!     tokens += pass.tokens.len();
//!     now = pass.end_ms;
//! }
//! assert_eq!(tokens, 3);
//! ```
#![deny(missing_docs)]

mod config;
mod pass;
pub mod preset;
mod prompt;
mod requests;
mod sglang;
pub mod timing;
mod vllm;

pub use config::{ConfigError, EngineConfig, SchedulerKind, SglangConfig, SglangPolicy, MAX_GPU_BLOCKS};
pub use pass::{Admission, Pass, TokenEmission};
pub use preset::{presets, Preset};
pub use prompt::{Prompt, PromptError, TokenRun};

use hangar_core::{KvEvent, RequestId};

use sglang::SglangScheduler;
use vllm::VllmScheduler;

/// A request handed to an engine.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// Unique among the engine's live requests.
    pub id: RequestId,
    /// The prompt, hashed with the engine's block size.
    pub prompt: Prompt,
    /// Exactly this many tokens are generated (the mock never stops early);
    /// 0 completes the request when its prefill ends.
    pub max_output_tokens: u32,
}

/// Why a request was refused; the engine's state is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddError {
    /// The prompt has no tokens.
    #[error("request {0} has an empty prompt")]
    EmptyPrompt(RequestId),
    /// A live request already has this id.
    #[error("request {0} is already in the engine")]
    Duplicate(RequestId),
    /// Prompt plus output can never fit in the KV cache (or, without chunked
    /// prefill, the prompt can never fit in one pass).
    #[error("request needs {tokens} tokens but the engine holds at most {capacity}")]
    TooLong {
        /// Tokens the request needs.
        tokens: u64,
        /// The most the engine can ever give it.
        capacity: u64,
    },
    /// The prompt was hashed with another block size than the engine's.
    #[error("prompt hashed with block size {prompt}, engine uses {engine}")]
    BlockSize {
        /// The prompt's block size.
        prompt: u32,
        /// The engine's.
        engine: u32,
    },
}

#[derive(Debug)]
enum Inner {
    Vllm(VllmScheduler),
    Sglang(SglangScheduler),
}

/// One mock engine: a scheduler state machine plus its timing model.
///
/// Drive it like this: add requests whenever they arrive; whenever the
/// engine is not inside a pass and [`has_work`](Self::has_work), call
/// [`step`](Self::step) with the current time; the pass's effects (tokens,
/// completions, KV events) take place at [`Pass::end_ms`], and the next step
/// may start then. Requests added during a pass wait for the next one.
#[derive(Debug)]
pub struct EngineCore {
    inner: Inner,
}

macro_rules! dispatch {
    ($self:expr, $s:ident => $e:expr) => {
        match &$self.inner {
            Inner::Vllm($s) => $e,
            Inner::Sglang($s) => $e,
        }
    };
    (mut $self:expr, $s:ident => $e:expr) => {
        match &mut $self.inner {
            Inner::Vllm($s) => $e,
            Inner::Sglang($s) => $e,
        }
    };
}

impl EngineCore {
    /// Builds an engine from a validated configuration. `load` reads the
    /// timing table file if the config names one.
    pub fn new(
        config: &EngineConfig,
        load: impl FnOnce(&str) -> Result<String, String>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let timing = config.build_timing(load)?;
        let inner = match config.scheduler {
            SchedulerKind::Vllm => Inner::Vllm(VllmScheduler::new(config, timing)),
            SchedulerKind::Sglang => Inner::Sglang(SglangScheduler::new(config, timing)),
        };
        Ok(Self { inner })
    }

    /// Turns KV event capture on or off (on by default). With it off, passes
    /// report no [`Pass::kv_events`], which saves time when nobody listens.
    pub fn set_kv_events(&mut self, on: bool) {
        dispatch!(mut self, s => s.set_kv_events(on))
    }

    /// Queues a request; it is considered from the next pass on.
    pub fn add_request(&mut self, request: EngineRequest) -> Result<(), AddError> {
        dispatch!(mut self, s => s.add(request))
    }

    /// Drops a request wherever it is, releasing its memory. Returns whether
    /// it was there.
    pub fn abort(&mut self, id: RequestId) -> bool {
        dispatch!(mut self, s => s.abort(id))
    }

    /// Runs one pass starting at `now` and writes what it did into `out`
    /// (cleared first). If nothing could run, `out.is_idle()` and
    /// `out.end_ms == now`.
    pub fn step(&mut self, now: f64, out: &mut Pass) {
        dispatch!(mut self, s => s.step(now, out))
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        self.num_running() + self.num_waiting() > 0
    }

    /// Requests currently running (holding KV memory).
    pub fn num_running(&self) -> usize {
        dispatch!(self, s => s.num_running())
    }

    /// Requests waiting to be (re)admitted.
    pub fn num_waiting(&self) -> usize {
        dispatch!(self, s => s.num_waiting())
    }

    /// Fraction of KV memory held by running requests, 0..=1.
    pub fn kv_usage(&self) -> f64 {
        dispatch!(self, s => s.kv_usage())
    }

    /// Forgets every cached prefix not held by a running request (what
    /// vLLM's sleep mode does to the KV cache); pushes
    /// [`KvEvent::Cleared`] when capture is on.
    pub fn clear_cache(&mut self, events: &mut Vec<KvEvent>) {
        dispatch!(mut self, s => s.clear_cache(events))
    }
}
