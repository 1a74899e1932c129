//! Moving a cached prefix between engines: one engine computes a prompt, another pulls the
//! prompt's blocks out of its cache (`export_prefix`, from the pool or the host tier) into
//! blocks it reserved (`reserve_import`, `write_kv_blocks`, `finish_import`), and then serves
//! the prompt from its own prefix cache with exactly the output of computing it.

mod common;

use common::run;
use kvmesh_common::{BlockHasher, ModelFingerprint, TokenId};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::LlmEngine;

fn engine(num_blocks: usize, host_tier_blocks: usize) -> LlmEngine<LlamaRunner> {
    common::engine(EngineConfig {
        num_blocks,
        host_tier_blocks,
        ..EngineConfig::default()
    })
}

fn prompt(topic: &str) -> Vec<TokenId> {
    common::note_prompt(topic)
}

/// Pulls `prompt`'s blocks from `holder` into `puller`; returns how many arrived.
fn pull(
    holder: &LlmEngine<LlamaRunner>,
    puller: &mut LlmEngine<LlamaRunner>,
    prompt: &[TokenId],
) -> usize {
    let import = puller
        .reserve_import(prompt, usize::MAX, |_| true)
        .expect("blocks to pull");
    let kv = holder.export_prefix(&import.hashes).expect("export");
    for (layer, payload) in kv.layers.iter().enumerate() {
        puller
            .write_kv_blocks(layer..layer + 1, &import.blocks[..kv.blocks], payload)
            .expect("write");
    }
    let arrived = kv.blocks;
    puller.finish_import(import, arrived);
    arrived
}

fn hasher() -> BlockHasher {
    // `common::engine` loads the model under fingerprint 1.
    BlockHasher::new(ModelFingerprint(1), 16)
}

#[test]
fn a_pulled_prefix_serves_the_prompt_with_the_computed_output() {
    let rivers = prompt("rivers");
    let mut holder = engine(64, 0);
    let (computed, _) = run(&mut holder, 1, &rivers);

    let mut puller = engine(64, 0);
    let arrived = pull(&holder, &mut puller, &rivers);
    let whole = (rivers.len() - 1) / 16;
    assert_eq!(arrived, whole, "every whole block but the last token's");
    let (served, cached) = run(&mut puller, 1, &rivers);
    assert_eq!(cached, whole * 16, "the pulled blocks are prefix hits");
    assert_eq!(served, computed, "pulled KV changed the output");

    // Nothing more to pull once it is cached here.
    assert!(puller
        .reserve_import(&rivers, usize::MAX, |_| true)
        .is_none());
}

#[test]
fn a_holder_sends_what_it_has_from_its_host_tier_and_stops_at_the_first_gap() {
    let (rivers, owls) = (prompt("rivers"), prompt("owls"));
    // Room for one prompt: computing the second offloads the first to host memory.
    let mut holder = engine(20, 64);
    let (computed, _) = run(&mut holder, 1, &rivers);
    run(&mut holder, 2, &owls);
    assert!(holder.host_tier_blocks() > 0, "nothing was offloaded");

    let mut puller = engine(64, 0);
    let arrived = pull(&holder, &mut puller, &rivers);
    assert_eq!(arrived, (rivers.len() - 1) / 16);
    let (served, _) = run(&mut puller, 1, &rivers);
    assert_eq!(served, computed);

    // Hashes nobody holds: nothing to send. A gap ends the run.
    let other = hasher().sequence_hashes(&prompt("volcanoes"));
    assert_eq!(holder.export_prefix(&other).unwrap().blocks, 0);
    let mut gapped = hasher().sequence_hashes(&owls);
    gapped[2] = other[0];
    assert_eq!(holder.export_prefix(&gapped).unwrap().blocks, 2);
}

#[test]
fn a_failed_pull_leaves_nothing_cached_and_no_block_held() {
    let rivers = prompt("rivers");
    let mut puller = engine(64, 0);
    let import = puller
        .reserve_import(&rivers, 4, |_| true)
        .expect("blocks to pull");
    assert_eq!(import.blocks.len(), 4);
    assert_eq!(puller.scheduler().pool().num_used(), 4);
    puller.finish_import(import, 0);
    assert_eq!(puller.scheduler().pool().num_used(), 0);
    assert_eq!(puller.scheduler().probe_prefix(&rivers), 0);
    // Too few free blocks: no reservation at all.
    let mut tiny = engine(2, 0);
    assert!(tiny.reserve_import(&rivers, usize::MAX, |_| true).is_none());
    assert_eq!(tiny.scheduler().pool().num_used(), 0);
}
