//! Workloads built from each source: lengths, content, determinism and errors.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use kvmesh_bench::load::Api;
use kvmesh_bench::trace::DEFAULT_TOKEN_IDS;
use kvmesh_bench::workload::{
    parse_azure, Prompt, WorkItem, Workload, WorkloadError, WorkloadOptions, WorkloadSpec,
    BUNDLED_AZURE_TRACE, ONE_TOKEN_WORDS,
};

fn load(spec: &str, api: Api, requests: usize, seed: u64) -> Workload {
    let spec: WorkloadSpec = spec.parse().unwrap();
    let opts = WorkloadOptions {
        seed,
        ..WorkloadOptions::new(api, requests)
    };
    spec.load(&opts).unwrap_or_else(|e| panic!("{spec}: {e}"))
}

/// A prompt's length: token ids, or words of text.
fn prompt_len(item: &WorkItem) -> usize {
    match &item.prompt {
        Prompt::Tokens(ids) => ids.len(),
        Prompt::Text(t) => t.split_whitespace().count(),
        Prompt::Messages(m) => m.iter().map(|m| m.content.split_whitespace().count()).sum(),
    }
}

fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// A file under the system's temporary directory, unique to this test process and `name`.
fn temp_file(name: &str, contents: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvmesh-workload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn synthetic_workloads_are_deterministic_from_the_seed() {
    let spec = "synthetic:input=uniform(10,50),output=normal(20,5)";
    for api in [Api::Completions, Api::Chat] {
        let a = load(spec, api, 50, 7);
        assert_eq!(a, load(spec, api, 50, 7));
        assert_ne!(a.items, load(spec, api, 50, 8).items);
        assert_eq!(a.name, spec);
    }
}

#[test]
fn fixed_lengths_are_exact() {
    let w = load("synthetic:input=37,output=11", Api::Completions, 200, 1);
    assert_eq!(w.items.len(), 200);
    for item in &w.items {
        let Prompt::Tokens(ids) = &item.prompt else {
            panic!("completions prompts are token ids: {:?}", item.prompt)
        };
        assert_eq!(ids.len(), 37);
        assert!(ids.iter().all(|t| DEFAULT_TOKEN_IDS.contains(t)));
        assert_eq!(item.max_tokens, 11);
        assert_eq!((item.at, item.previous_turn), (None, None));
    }
    let leads: HashSet<u32> = w
        .items
        .iter()
        .map(|i| match &i.prompt {
            Prompt::Tokens(ids) => ids[0],
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(leads.len(), 200, "no two prompts share a prefix");
}

#[test]
fn uniform_and_normal_lengths_have_their_statistics() {
    let n = 4000;
    let w = load(
        "synthetic:input=uniform(64,512),output=normal(256,64)",
        Api::Completions,
        n,
        3,
    );
    let inputs: Vec<f64> = w.items.iter().map(|i| prompt_len(i) as f64).collect();
    let outputs: Vec<f64> = w.items.iter().map(|i| f64::from(i.max_tokens)).collect();
    assert!(inputs.iter().all(|&x| (64.0..=512.0).contains(&x)));
    assert!(
        inputs.contains(&64.0) && inputs.contains(&512.0),
        "both ends drawn"
    );
    let (mean, sd) = mean_sd(&inputs);
    // Uniform on 64..=512: mean 288, sd sqrt((449^2 - 1) / 12) = 129.6; the mean's standard
    // error is 2.0, so 5 standard errors for the mean and ~4% for the sd.
    assert!((mean - 288.0).abs() < 10.0, "{mean}");
    assert!((sd - 129.6).abs() < 6.0, "{sd}");
    let (mean, sd) = mean_sd(&outputs);
    assert!((mean - 256.0).abs() < 5.0, "{mean}");
    assert!((sd - 64.0).abs() < 3.5, "{sd}");
    // Clipped to at least 1.
    let w = load(
        "synthetic:input=normal(2,10),output=1",
        Api::Completions,
        500,
        3,
    );
    assert!(w.items.iter().all(|i| prompt_len(i) >= 1));
    assert!(w.items.iter().any(|i| prompt_len(i) == 1));
}

#[test]
fn chat_prompts_are_text_of_the_requested_word_count() {
    let w = load("synthetic:input=uniform(1,300),output=8", Api::Chat, 100, 5);
    let words: HashSet<&str> = ONE_TOKEN_WORDS.iter().copied().collect();
    let lens = load(
        "synthetic:input=uniform(1,300),output=8",
        Api::Completions,
        100,
        5,
    );
    for (chat, tokens) in w.items.iter().zip(&lens.items) {
        let Prompt::Text(text) = &chat.prompt else {
            panic!("{:?}", chat.prompt)
        };
        assert_eq!(
            prompt_len(chat),
            prompt_len(tokens),
            "same lengths per seed"
        );
        assert!(text.split_whitespace().all(|w| words.contains(w)));
        assert!(
            text.starts_with(' ') && !text.contains("  "),
            "each word has its space"
        );
    }
    let w = load("synthetic:input=37,output=8", Api::Chat, 20, 5);
    assert!(w.items.iter().all(|i| prompt_len(i) == 37));
    let w = load("synthetic:input=12,output=8,prefix=20", Api::Chat, 3, 5);
    for item in &w.items {
        let Prompt::Messages(m) = &item.prompt else {
            panic!("{:?}", item.prompt)
        };
        assert_eq!(m[0].role, "system");
        assert_eq!(m[0].content.split_whitespace().count(), 20);
        assert_eq!(m[1].role, "user");
        assert_eq!(m[1].content.split_whitespace().count(), 12);
    }
    let Prompt::Messages(a) = &w.items[0].prompt else {
        unreachable!()
    };
    let Prompt::Messages(b) = &w.items[1].prompt else {
        unreachable!()
    };
    assert_eq!(a[0], b[0], "one system prefix");
    assert_ne!(a[1], b[1]);
}

#[test]
fn a_prefix_is_shared_by_every_token_prompt() {
    let w = load(
        "synthetic:input=10,output=4,prefix=16",
        Api::Completions,
        20,
        9,
    );
    let ids: Vec<&Vec<u32>> = w
        .items
        .iter()
        .map(|i| match &i.prompt {
            Prompt::Tokens(ids) => ids,
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(ids.iter().all(|p| p.len() == 26 && p[..16] == ids[0][..16]));
    let after: HashSet<u32> = ids.iter().map(|p| p[16]).collect();
    assert_eq!(after.len(), 20, "the rest is each prompt's own");
}

#[test]
fn azure_lengths_are_pairs_from_the_trace() {
    let pairs: HashSet<(u64, u64)> = parse_azure(BUNDLED_AZURE_TRACE.as_bytes(), "azure")
        .unwrap()
        .iter()
        .map(|r| (r.context_tokens, r.generated_tokens))
        .collect();
    let w = load(
        "synthetic:input=azure,output=azure",
        Api::Completions,
        300,
        2,
    );
    for item in &w.items {
        let pair = (prompt_len(item) as u64, u64::from(item.max_tokens));
        assert!(pairs.contains(&pair), "{pair:?} is not a row of the trace");
    }
    let distinct: HashSet<usize> = w.items.iter().map(prompt_len).collect();
    assert!(
        distinct.len() > 100,
        "drawn, not one row: {}",
        distinct.len()
    );
    // Scaled and capped.
    let w = load(
        "synthetic:input=azure,output=azure,scale=4,max_input=200,max_output=50",
        Api::Completions,
        300,
        2,
    );
    let unscaled = load(
        "synthetic:input=azure,output=azure",
        Api::Completions,
        300,
        2,
    );
    for (s, u) in w.items.iter().zip(&unscaled.items) {
        assert_eq!(prompt_len(s), prompt_len(u).div_ceil(4).min(200));
        assert_eq!(s.max_tokens, u.max_tokens.div_ceil(4).min(50));
    }
}

#[test]
fn the_azure_trace_gives_arrivals_and_lengths() {
    let w = load("azure", Api::Completions, 100, 0);
    assert_eq!(w.items.len(), 100);
    assert_eq!(w.ideal_hit_rate(), 0.0, "no hash ids");
    let first = parse_azure(BUNDLED_AZURE_TRACE.as_bytes(), "azure").unwrap();
    assert_eq!(prompt_len(&w.items[0]), first[0].context_tokens as usize);
    assert_eq!(u64::from(w.items[0].max_tokens), first[0].generated_tokens);
    assert_eq!(w.items[0].at, Some(Duration::ZERO));
    // The second request came 4.314579 s after the first.
    assert_eq!(w.items[1].at, Some(Duration::from_nanos(4_314_579_000)));
    assert!(w.items.windows(2).all(|p| p[0].at <= p[1].at));
    let scaled = load("azure,scale=2", Api::Chat, 100, 0);
    assert_eq!(
        prompt_len(&scaled.items[0]),
        (first[0].context_tokens as usize).div_ceil(2)
    );
    let capped = WorkloadOptions {
        max_tokens: Some(10),
        ..WorkloadOptions::new(Api::Completions, 100)
    };
    let w = "azure"
        .parse::<WorkloadSpec>()
        .unwrap()
        .load(&capped)
        .unwrap();
    assert!(w.items.iter().all(|i| i.max_tokens <= 10));
    let file = temp_file(
        "azure.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:01,5,2\n2023-11-16 18:00:00.5,3,1\n",
    );
    let w = load(
        &format!("azure:{}", file.display()),
        Api::Completions,
        10,
        0,
    );
    let lens: Vec<usize> = w.items.iter().map(prompt_len).collect();
    assert_eq!(lens, [3, 5], "in arrival order");
    assert_eq!(w.items[1].at, Some(Duration::from_millis(500)));
}

#[test]
fn mooncake_shared_hash_ids_are_shared_prefixes() {
    for api in [Api::Completions, Api::Chat] {
        let w = load("mooncake,scale=16", api, 400, 0);
        assert_eq!(w.items.len(), 400);
        assert!(w.items.windows(2).all(|p| p[0].at <= p[1].at));
        assert_eq!(w.items[0].at, Some(Duration::ZERO));
        let block = 512 / 16;
        let mut shared = 0;
        // Each prompt as a sequence: its token ids, or its words.
        let seqs: Vec<Vec<String>> = w
            .items
            .iter()
            .map(|i| match &i.prompt {
                Prompt::Tokens(ids) => ids.iter().map(u32::to_string).collect(),
                Prompt::Text(t) => t.split_whitespace().map(str::to_owned).collect(),
                other => panic!("{other:?}"),
            })
            .collect();
        for (i, a) in w.items.iter().enumerate() {
            for (j, b) in w.items.iter().enumerate().skip(i + 1) {
                // Whole blocks only: a prompt's last block may be cut short.
                let common = a
                    .hash_ids
                    .iter()
                    .zip(&b.hash_ids)
                    .take_while(|(x, y)| x == y)
                    .count()
                    .min(a.hash_ids.len() - 1)
                    .min(b.hash_ids.len() - 1);
                if common == 0 {
                    continue;
                }
                shared += 1;
                assert_eq!(seqs[i][..common * block], seqs[j][..common * block]);
                // And they differ where the blocks do (when long enough not to match by
                // chance: a one-word partial block matches one time in 224).
                let end = ((common + 1) * block).min(seqs[i].len()).min(seqs[j].len());
                if a.hash_ids[common] != b.hash_ids[common] && end >= common * block + 8 {
                    assert_ne!(seqs[i][common * block..end], seqs[j][common * block..end]);
                }
            }
        }
        assert!(shared > 100, "the trace shares prefixes: {shared}");
        let ideal = w.ideal_hit_rate();
        assert!(ideal > 0.0 && ideal < 1.0, "{ideal}");
        let followed = w.items.iter().filter(|i| i.previous_turn.is_some()).count();
        for (i, item) in w.items.iter().enumerate() {
            if let Some(p) = item.previous_turn {
                assert!(p < i);
                let before = &w.items[p].hash_ids;
                assert!(item.hash_ids.starts_with(&before[..before.len() - 1]));
            }
        }
        assert!(followed > 10, "follow-up turns are linked: {followed}");
    }
    let w = load(
        "mooncake,scale=16,conversations=5",
        Api::Completions,
        10_000,
        0,
    );
    assert!(w.items.iter().filter(|i| i.previous_turn.is_some()).count() >= 5);
    let cut = load("mooncake,scale=16,conversations=5", Api::Completions, 7, 0);
    assert_eq!(
        cut.items[..],
        w.items[..7],
        "the cap keeps the first requests"
    );
}

#[test]
fn jsonl_and_sharegpt_files_are_read() {
    let jsonl = temp_file(
        "prompts.jsonl",
        "{\"prompt\": \"one\"}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"two\"}], \"max_tokens\": 3}\n",
    );
    let err = format!("jsonl:{}", jsonl.display())
        .parse::<WorkloadSpec>()
        .unwrap()
        .load(&WorkloadOptions::new(Api::Completions, 10))
        .unwrap_err();
    assert!(
        matches!(err, WorkloadError::MessagesForCompletions { line: 3, .. }),
        "{err}"
    );
    let w = load(&format!("jsonl:{}", jsonl.display()), Api::Chat, 10, 0);
    assert_eq!(w.items.len(), 2);
    assert_eq!(w.items[0].prompt, Prompt::Text("one".into()));
    assert_eq!(w.items[1].max_tokens, 3);
    let sharegpt = temp_file(
        "sharegpt.json",
        r#"[{"id": "1", "conversations": [{"from": "human", "value": "why?"}, {"from": "gpt", "value": "because it is so"}]}]"#,
    );
    let w = load(
        &format!("sharegpt:{}", sharegpt.display()),
        Api::Completions,
        10,
        0,
    );
    assert_eq!(w.items.len(), 1);
    assert_eq!(w.items[0].prompt, Prompt::Text("why?".into()));
    assert_eq!(w.items[0].max_tokens, 4, "16 characters, 4 tokens");
}

#[test]
fn bad_sources_are_clear_errors() {
    let opts = WorkloadOptions::new(Api::Chat, 10);
    let load_err = |spec: &str, opts: &WorkloadOptions| {
        spec.parse::<WorkloadSpec>()
            .unwrap()
            .load(opts)
            .unwrap_err()
    };
    let e = load_err("jsonl:/no/such/prompts.jsonl", &opts);
    assert!(matches!(e, WorkloadError::Open { .. }), "{e}");
    assert!(e.to_string().contains("/no/such/prompts.jsonl"), "{e}");
    let e = load_err("sharegpt:/no/such/sharegpt.json", &opts);
    assert!(e.to_string().contains("/no/such/sharegpt.json"), "{e}");
    let e = load_err("mooncake:/no/such/trace.jsonl", &opts);
    assert!(e.to_string().contains("/no/such/trace.jsonl"), "{e}");
    let empty = temp_file("empty.jsonl", "\n\n");
    let e = load_err(&format!("jsonl:{}", empty.display()), &opts);
    assert!(matches!(e, WorkloadError::Empty(_)), "{e}");
    assert!(e.to_string().ends_with("holds no requests"), "{e}");
    let e = load_err("azure", &WorkloadOptions::new(Api::Chat, 0));
    assert!(matches!(e, WorkloadError::ZeroRequests), "{e}");
    let bad = temp_file(
        "bad.jsonl",
        "{\"prompt\": \"a\"}\n{\"prompt\": [1, \"x\"]}\n",
    );
    let e = load_err(&format!("jsonl:{}", bad.display()), &opts);
    assert!(matches!(e, WorkloadError::Malformed { line: 2, .. }), "{e}");
    let tokens = temp_file("tokens.jsonl", "{\"prompt\": [1, 2]}\n");
    let e = load_err(&format!("jsonl:{}", tokens.display()), &opts);
    assert!(
        matches!(e, WorkloadError::TokensForChat { line: 1, .. }),
        "{e}"
    );
    let e = load_err(
        "synthetic:input=1,output=1",
        &WorkloadOptions {
            max_tokens: Some(0),
            ..opts.clone()
        },
    );
    assert!(matches!(e, WorkloadError::ZeroMaxTokens), "{e}");
}
