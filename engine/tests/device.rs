//! `--device`: CPU by default; CUDA where the build and the machine allow, else an error at
//! start that says why (this machine has no CUDA driver, and CI builds without the feature).

use kvmesh_common::BlockId;
use kvmesh_engine::device::Device;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::random_model::{random_model, smollm2_135m};
use kvmesh_engine::runner::{ModelRunner, SeqChunk, StepInput};
use kvmesh_kernels::WeightFormat;
use std::sync::Arc;

fn tiny() -> Arc<kvmesh_engine::model::LlamaModel> {
    let mut c = smollm2_135m();
    c.num_layers = 2;
    c.vocab_size = 256;
    Arc::new(random_model(c, WeightFormat::Q4_1, 1, 1.0))
}

#[test]
fn cuda_without_a_usable_device_fails_at_start_and_says_why() {
    if kvmesh_kernels::cuda::is_available() {
        return; // a GPU machine: `kvmesh gpu-check` covers this path
    }
    let err = LlamaRunner::on_device(Device::Cuda(0), tiny(), 8, 16)
        .err()
        .expect("no CUDA device here");
    let msg = err.to_string();
    assert!(msg.starts_with("--device cuda:0: "), "{msg}");
    let why = if cfg!(feature = "cuda") {
        "no CUDA driver"
    } else {
        "built without CUDA support"
    };
    assert!(msg.contains(why), "{msg}");
}

#[test]
fn cpu_is_the_default_and_runs() {
    assert_eq!(Device::default(), Device::Cpu);
    let mut r = LlamaRunner::on_device(Device::Cpu, tiny(), 8, 16).unwrap();
    let out = r
        .execute(&StepInput {
            chunks: vec![SeqChunk {
                seq_id: 1,
                tokens: vec![1, 2, 3].into(),
                start_pos: 0,
                block_table: [BlockId(0)].into(),
                want_logits: true,
            }],
        })
        .unwrap();
    assert_eq!(out.logits.len(), 1);
    assert_eq!(out.logits[0].1.len(), 256);
    assert!(out.logits[0].1.iter().all(|x| x.is_finite()));
}
