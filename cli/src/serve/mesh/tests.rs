//! `LocalMesh` on the real model: requests through its handles, and through the router's
//! `MeshBackend` over them, match a lone engine's run.

use super::*;
use kvmesh_common::{GenerateEvent, GenerateRequest, RequestId, SamplingParams, TokenId};
use std::sync::OnceLock;

/// The default model, loaded once.
fn loaded() -> &'static Loaded {
    static MODEL: OnceLock<Loaded> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"));
        kvmesh_engine::load(&path).expect("model loads")
    })
}

/// Small pools and a modest step budget, so prompts prefill in several chunks.
fn engine_config() -> EngineConfig {
    EngineConfig {
        num_blocks: 256,
        max_model_len: Some(2048),
        ..EngineConfig::default()
    }
}

/// `prefill_workers` and two decode workers that send prompts over 32 tokens to them.
fn disaggregated(prefill_workers: usize) -> LocalMeshConfig {
    LocalMeshConfig {
        prefill_workers,
        decode_workers: 2,
        prefill_engine: engine_config(),
        decode_engine: engine_config(),
        decode: DecodeConfig {
            local_prefill_max_tokens: 32,
            ..DecodeConfig::new(NodeId(0))
        },
        ..Default::default()
    }
}

/// `len` real tokens, different for each `seed`.
fn request(seed: u64, len: usize, max_tokens: u32) -> GenerateRequest {
    let text = "Networks joined the machines, and distributed systems learned to survive \
        the failure of any one of them, while a key-value cache moves between them.";
    let base = loaded().tokenizer.encode(text, false).unwrap();
    let prompt = (0..len)
        .map(|i| base[(seed as usize * 17 + i) % base.len()])
        .collect();
    GenerateRequest {
        request_id: RequestId(seed),
        prompt,
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
        resume: Vec::new(),
    }
}

/// What a lone engine generates for `request`.
fn reference(request: &GenerateRequest) -> Vec<TokenId> {
    let mut e = engine_config().llama_engine(loaded()).unwrap();
    e.add_request(0, request.prompt.clone(), request.params.clone(), 0)
        .unwrap();
    let mut tokens = Vec::new();
    while e.has_work() {
        for out in e.step().unwrap() {
            tokens.extend(out.sampled.map(|s| s.token));
        }
    }
    tokens
}

/// The tokens of a stream that must end with `Finished`.
fn collect(mut rx: kvmesh_decode::EventReceiver) -> Vec<TokenId> {
    let mut tokens = Vec::new();
    loop {
        match rx.blocking_recv().expect("the stream ends with Finished") {
            GenerateEvent::Token(t) => tokens.push(t.token),
            GenerateEvent::Finished { .. } => return tokens,
            GenerateEvent::Error(e) => panic!("stream failed: {e}"),
        }
    }
}

/// Remote prefills whose KV the decode worker `node` received whole (from its metrics).
fn transfers_completed(node: NodeId) -> u64 {
    let node = node.to_string();
    let labels = [("node", &node[..]), ("role", "decode")];
    let scrape = kvmesh_router::metrics_exporter().render();
    let count = format!("{}_count", kvmesh_common::metrics::TRANSFER_SECONDS);
    kvmesh_common::metrics::scraped_sum(&scrape, &count, &labels) as u64
}

#[test]
fn a_local_mesh_serves_through_its_handles() {
    let config = disaggregated(2);
    let mesh = LocalMesh::start(loaded(), &config).unwrap();
    let (decode, prefill) = (mesh.decode_handles(), mesh.prefill_handles());
    assert_eq!(decode.len(), 2);
    let requests: Vec<_> = (0..4).map(|i| request(i, 90, 6)).collect();
    let streams: Vec<_> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            decode[i % 2]
                .generate(r.clone(), Some(prefill[i / 2].clone().into()))
                .unwrap()
        })
        .collect();
    for (r, s) in requests.iter().zip(streams) {
        assert_eq!(collect(s), reference(r));
    }
    for d in &decode {
        assert_eq!(transfers_completed(d.node_id()), 2);
    }
    mesh.shutdown();
    assert!(decode[0].generate(requests[0].clone(), None).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_backend_passes_over_a_draining_worker() {
    use crate::serve::in_process::LocalWorkers;
    use kvmesh_kvstore::InMemoryPrefixIndex;
    use kvmesh_router::policy::{DisaggConfig, RoutingConfig};
    use kvmesh_router::routing::Routing;
    use kvmesh_router::{Backend, MeshBackend, MeshBackendConfig};

    let config = LocalMeshConfig {
        prefill_workers: 0,
        decode_workers: 2,
        decode_engine: engine_config(),
        ..Default::default()
    };
    let mesh = LocalMesh::start(loaded(), &config).unwrap();
    // Round robin starts with the first worker, which refuses: it is draining.
    let decode = mesh.decode_handles();
    decode[0].drain();
    let routing = Routing::new(
        "round_robin".parse::<RoutingConfig>().unwrap().build(),
        DisaggConfig::default(),
        Arc::new(InMemoryPrefixIndex::new()),
        loaded().fingerprint,
    );
    let workers = LocalWorkers::of(&mesh);
    let backend = MeshBackend::with_connector(
        workers.clone(),
        Arc::new(workers.discovery(&config, loaded().fingerprint)),
        MeshBackendConfig::default(),
        routing,
    );
    assert!(backend.is_ready());
    for seed in 0..3 {
        let r = request(seed, 40, 4);
        let mut events = backend.generate(r.clone()).await.unwrap();
        let mut tokens = Vec::new();
        loop {
            match events.recv().await.expect("the stream ends with Finished") {
                GenerateEvent::Token(t) => tokens.push(t.token),
                GenerateEvent::Finished { .. } => break,
                GenerateEvent::Error(e) => panic!("request {seed} failed: {e}"),
            }
        }
        assert_eq!(tokens, reference(&r), "request {seed}");
    }
    backend.drain();
    assert!(!backend.is_ready());
    assert!(backend.generate(request(9, 40, 4)).await.is_err());
    mesh.shutdown();
}

#[test]
fn workers_switch_roles_come_and_go_and_every_stream_keeps_its_tokens() {
    let config = disaggregated(1);
    let mesh = LocalMesh::start(loaded(), &config).unwrap();
    let decode_ids =
        || -> Vec<NodeId> { mesh.decode_handles().iter().map(|h| h.node_id()).collect() };
    let prefill_ids =
        || -> Vec<NodeId> { mesh.prefill_handles().iter().map(|h| h.node_id()).collect() };
    let (d0, d1, p0) = (NodeId(0x200), NodeId(0x201), NodeId(0x100));
    assert_eq!((decode_ids(), prefill_ids()), (vec![d0, d1], vec![p0]));

    // Requests open on the worker that switches (short prompts, prefilled there: the test
    // beside this one counts the remote prefills of 0x200 and 0x201): it finishes them
    // before it flips.
    let requests: Vec<_> = (0..4).map(|i| request(10 + i, 24, 8)).collect();
    let decode1 = mesh.decode_handles()[1].clone();
    let streams: Vec<_> = requests
        .iter()
        .map(|r| decode1.generate(r.clone(), None).unwrap())
        .collect();
    let left = mesh.switch(d1, NodeRole::Prefill).unwrap();
    assert!(left.finished, "the drain cut requests short");
    for (r, s) in requests.iter().zip(streams) {
        assert_eq!(collect(s), reference(r));
    }
    assert!(
        decode1.generate(requests[0].clone(), None).is_err(),
        "the old role refuses"
    );
    assert_eq!((decode_ids(), prefill_ids()), (vec![d0], vec![p0, d1]));

    // The first prefill worker becomes a decode worker, a new decode worker joins, and the
    // switched worker prefills for both.
    mesh.switch(p0, NodeRole::Decode).unwrap();
    let added = mesh.add(NodeRole::Decode).unwrap();
    assert_eq!(added, NodeId(0x300));
    assert_eq!(
        (decode_ids(), prefill_ids()),
        (vec![p0, d0, added], vec![d1])
    );
    let prefill = mesh.prefill_handles()[0].clone();
    for (i, h) in mesh.decode_handles().into_iter().enumerate() {
        let remote = h.node_id() != d0;
        let r = request(30 + i as u64, if remote { 90 } else { 24 }, 6);
        let s = h.generate(r.clone(), remote.then(|| prefill.clone().into()));
        assert_eq!(collect(s.unwrap()), reference(&r));
    }
    assert_eq!(
        transfers_completed(p0),
        1,
        "prefilled by the switched worker"
    );
    assert_eq!(transfers_completed(added), 1);

    // Asking for the role a worker has changes nothing; a removed worker is gone.
    assert_eq!(mesh.switch(d1, NodeRole::Prefill).unwrap().seconds, 0.0);
    assert!(mesh.remove(added).unwrap().finished);
    assert_eq!(decode_ids(), vec![p0, d0]);
    assert!(matches!(
        mesh.remove(added),
        Err(MeshError::UnknownWorker(id)) if id == added
    ));
    mesh.shutdown();
    assert!(matches!(
        mesh.add(NodeRole::Decode),
        Err(MeshError::ShuttingDown)
    ));
    assert!(decode_ids().is_empty() && prefill_ids().is_empty());
}
