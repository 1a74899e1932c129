//! `kvmesh bench scripted-server` (hidden): an OpenAI-compatible server that streams
//! `max_tokens` tokens on a fixed script, to benchmark the load generator itself (see
//! `kvmesh_bench::load::scripted`).

use std::num::NonZeroU64;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::http::StatusCode;
use clap::Args;
use humantime_serde::re::humantime;
use kvmesh_bench::load::scripted::{self, Injection, Script};

#[derive(Args, Debug)]
pub struct ScriptedServerArgs {
    /// Address to listen on (port 0: any free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:8123")]
    pub listen: String,
    /// From a request's arrival to its first token (`0ms`, `50ms`, `1s`).
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    pub ttft: Duration,
    /// Between tokens.
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    pub itl: Duration,
    /// Answer every K-th request with `--inject-status` instead of a stream.
    #[arg(long, value_name = "K")]
    pub inject_every: Option<NonZeroU64>,
    /// The status of injected answers.
    #[arg(long, default_value_t = 429, value_parser = clap::value_parser!(u16).range(400..600))]
    pub inject_status: u16,
    /// The model name the server reports.
    #[arg(long, default_value = "scripted")]
    pub model: String,
    /// Server threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

pub fn run(args: &ScriptedServerArgs) -> Result<()> {
    let inject = match args.inject_every {
        Some(every) => Some(Injection {
            every,
            status: StatusCode::from_u16(args.inject_status)
                .context("--inject-status is not an HTTP status")?,
        }),
        None => None,
    };
    let script = Script {
        ttft: args.ttft,
        itl: args.itl,
        inject,
        model: args.model.clone(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        println!("listening on http://{}", listener.local_addr()?);
        scripted::serve(listener, script).await.context("serving")
    })
}
