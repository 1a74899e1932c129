//! The engine's side of sampling on the device, without a device: a runner that draws (as
//! the CUDA backend does with `device_sampling`) is handed exactly the draws the engine may
//! leave to it, and the engine emits the drawn tokens as it emits its own; sequences whose
//! draw needs the host (penalties, biases, log-probabilities, top logits) still get logits.
//! The runner here is the CPU runner whose "device" draw is the host's greedy argmax over the
//! same logits, so greedy output must not change; what the CUDA kernels draw is checked on a
//! GPU by `kvmesh gpu-check`.

use kvmesh_common::{SamplingParams, TokenId};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::random_model::{random_loaded, smollm2_135m};
use kvmesh_engine::runner::{
    DeviceDraw, KvShape, KvSource, ModelRunner, RunnerError, SeqId, StepInput, StepOutput,
};
use kvmesh_engine::sampler::argmax;
use kvmesh_kernels::WeightFormat;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// The CPU runner, drawing greedily for the draws it is given, recording them.
struct Drawing {
    inner: LlamaRunner,
    seen: Arc<Mutex<Vec<DeviceDraw>>>,
}

impl KvSource for Drawing {
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[kvmesh_common::BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError> {
        self.inner.read_kv_blocks(layer, blocks, out)
    }
}

impl ModelRunner for Drawing {
    fn kv_shape(&self) -> KvShape {
        self.inner.kv_shape()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn execute_observed(
        &mut self,
        input: &StepInput,
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<StepOutput, RunnerError> {
        self.inner.execute_observed(input, on_layer)
    }
    fn draws_on_device(&self) -> bool {
        true
    }
    fn execute_drawing(
        &mut self,
        input: &StepInput,
        draws: &[DeviceDraw],
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<StepOutput, RunnerError> {
        self.seen.lock().unwrap().extend_from_slice(draws);
        let out = self.inner.execute_observed(input, on_layer)?;
        let (mut logits, mut drawn) = (Vec::new(), Vec::new());
        for (seq_id, l) in out.logits {
            match draws.iter().find(|d| d.seq_id == seq_id) {
                Some(d) => {
                    assert_eq!(d.params.temperature, 0.0, "only greedy draws here");
                    drawn.push((seq_id, argmax(&l)));
                }
                None => logits.push((seq_id, l)),
            }
        }
        Ok(StepOutput { logits, drawn })
    }
    fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[kvmesh_common::BlockId],
        payload: &[u8],
    ) -> Result<(), RunnerError> {
        self.inner.write_kv_blocks(layers, blocks, payload)
    }
}

fn loaded() -> kvmesh_engine::Loaded {
    let mut c = smollm2_135m();
    c.num_layers = 2;
    c.vocab_size = 1024;
    random_loaded(c, WeightFormat::Q4_1, 3, 1.0)
}

/// Every sequence's tokens, running `requests` (params, top logits) to the end.
fn run<R: ModelRunner>(
    mut e: LlmEngine<R>,
    requests: &[(SamplingParams, usize)],
) -> HashMap<SeqId, Vec<TokenId>> {
    for (i, (params, top)) in requests.iter().enumerate() {
        let prompt: Vec<TokenId> = (0..20).map(|t| (t * 37 + i as u32 * 11) % 1024).collect();
        e.add_request(i as SeqId, prompt, params.clone(), *top)
            .unwrap();
    }
    let mut out: HashMap<SeqId, Vec<TokenId>> = HashMap::new();
    while e.has_work() {
        for o in e.step().unwrap() {
            out.entry(o.seq_id)
                .or_default()
                .extend(o.sampled.map(|s| s.token));
        }
    }
    out
}

#[test]
fn the_engine_leaves_plain_draws_to_the_device_and_keeps_the_rest() {
    let loaded = loaded();
    let config = EngineConfig {
        num_blocks: 64,
        ..EngineConfig::default()
    };
    let greedy = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(6)
    };
    let requests = [
        (greedy.clone(), 0),
        (
            SamplingParams {
                repetition_penalty: 1.3,
                ..greedy.clone()
            },
            0,
        ),
        (
            SamplingParams {
                logprobs: Some(2),
                ..greedy.clone()
            },
            0,
        ),
        (greedy.clone(), 3),
    ];
    let host = run(config.llama_engine(&loaded).unwrap(), &requests);

    let seen = Arc::new(Mutex::new(Vec::new()));
    let runner = Drawing {
        inner: LlamaRunner::new(loaded.model.clone(), config.num_blocks, config.block_size),
        seen: seen.clone(),
    };
    let scheduler = config.scheduler_config(loaded.fingerprint, loaded.model.config.max_context);
    let engine = LlmEngine::new(scheduler, runner, loaded.tokenizer.clone());
    let device = run(engine, &requests);

    assert_eq!(device, host, "greedy output is the same whoever draws");
    let seen = seen.lock().unwrap();
    // Only sequence 0 is plain: one draw per token, each with its own number in [0, 1).
    assert_eq!(seen.len(), 6);
    assert!(seen.iter().all(|d| d.seq_id == 0));
    assert!(seen.iter().all(|d| (0.0..1.0).contains(&d.uniform)));
}
