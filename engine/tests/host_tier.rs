//! The tiers behind the prefix cache: a prompt whose blocks the pool evicted (to make room
//! for another) is served from host memory, or from disk past it, when it comes back, with
//! exactly the output it had when computed from scratch; without the tiers it is recomputed.
//! A restarted engine finds its disk tier again and serves from it.

mod common;

use common::run;
use kvmesh_common::TokenId;
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::LlmEngine;

/// 20 blocks of 16 tokens: two prompts of about 190 tokens cannot both stay cached.
fn engine(host_tier_blocks: usize) -> LlmEngine<LlamaRunner> {
    engine_with(host_tier_blocks, 0, None)
}

fn engine_with(
    host_tier_blocks: usize,
    disk_tier_blocks: usize,
    disk_tier_dir: Option<&std::path::Path>,
) -> LlmEngine<LlamaRunner> {
    common::engine(EngineConfig {
        num_blocks: 20,
        host_tier_blocks,
        disk_tier_blocks,
        disk_tier_dir: disk_tier_dir.map(Into::into),
        ..EngineConfig::default()
    })
}

fn prompt(topic: &str) -> Vec<TokenId> {
    let ids = common::note_prompt(topic);
    assert!(ids.len() > 150 && ids.len() < 250, "{} tokens", ids.len());
    ids
}

#[test]
fn an_evicted_prefix_comes_back_from_host_memory_with_the_same_output() {
    let (rivers, owls) = (prompt("rivers"), prompt("owls"));
    let mut e = engine(64);
    let (first, cached) = run(&mut e, 1, &rivers);
    assert_eq!(cached, 0);
    // The second prompt needs blocks that only evicting the first one's can give.
    run(&mut e, 2, &owls);
    assert!(e.host_tier_blocks() > 0, "nothing was offloaded");
    let (again, cached) = run(&mut e, 3, &rivers);
    let whole_blocks = (rivers.len() - 1) / 16 * 16;
    assert!(
        cached >= whole_blocks / 2,
        "only {cached} of {whole_blocks} tokens came from the cache"
    );
    assert_eq!(again, first, "the promoted KV changed the output");

    // Without the tier the same sequence of requests recomputes.
    let mut e = engine(0);
    run(&mut e, 1, &rivers);
    run(&mut e, 2, &owls);
    let (recomputed, cached_without) = run(&mut e, 3, &rivers);
    assert_eq!(recomputed, first);
    assert!(
        cached_without < cached,
        "the tier made no difference ({cached_without} vs {cached} cached tokens)"
    );
}

#[test]
fn past_host_memory_blocks_go_to_disk_and_survive_a_restart() {
    let (rivers, owls) = (prompt("rivers"), prompt("owls"));
    let dir = tempfile::tempdir().unwrap();
    let whole_blocks = (rivers.len() - 1) / 16 * 16;
    // Host memory for 2 blocks: the rest of what is evicted goes on to disk.
    let mut e = engine_with(2, 64, Some(dir.path()));
    let (first, _) = run(&mut e, 1, &rivers);
    run(&mut e, 2, &owls);
    assert!(e.disk_tier_blocks() > 0, "nothing reached the disk tier");
    let (again, cached) = run(&mut e, 3, &rivers);
    assert_eq!(again, first, "KV back from disk changed the output");
    assert!(
        cached >= whole_blocks / 2,
        "{cached} of {whole_blocks} cached"
    );

    // With no host memory, evicted blocks go straight to disk, where a restarted engine on
    // the same directory finds them (host memory does not survive a restart).
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine_with(0, 64, Some(dir.path()));
    run(&mut e, 1, &rivers);
    // Two other prompts push every block of the first out of the pool.
    run(&mut e, 2, &owls);
    run(&mut e, 3, &prompt("bread"));
    let on_disk = e.disk_tier_blocks();
    assert!(on_disk > 0);
    drop(e);
    // A corrupt file is never used: the block is recomputed, and the request gets the
    // output it would have had. The same disk, every file with one byte flipped:
    let bad = tempfile::tempdir().unwrap();
    let mut copied = 0;
    for f in std::fs::read_dir(dir.path()).unwrap() {
        let path = f.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xFF;
        std::fs::write(bad.path().join(path.file_name().unwrap()), bytes).unwrap();
        copied += 1;
    }
    assert!(copied > 0);
    let mut corrupt = engine_with(0, 64, Some(bad.path()));
    let (recomputed, cached) = run(&mut corrupt, 9, &rivers);
    assert_eq!(recomputed, first, "a corrupt disk block changed the output");
    assert_eq!(cached, 0, "a corrupt disk block counted as a hit");
    // What was recomputed is cached as usual.
    let (again, cached) = run(&mut corrupt, 10, &rivers);
    assert_eq!((again, cached), (first.clone(), whole_blocks));

    let mut restarted = engine_with(0, 64, Some(dir.path()));
    assert_eq!(
        restarted.disk_tier_blocks(),
        on_disk,
        "the restart lost the disk tier"
    );
    let (after, cached) = run(&mut restarted, 1, &rivers);
    assert_eq!(
        after, first,
        "KV from a previous run's disk changed the output"
    );
    assert!(
        cached >= whole_blocks / 2,
        "{cached} of {whole_blocks} from the old disk"
    );
}
