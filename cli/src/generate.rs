//! `kvmesh generate`: one prompt through the engine on this machine, streamed to stdout.

use crate::model_args::{self, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvmesh_common::SamplingParams;
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_prompt::chat_template::{ChatMessage, ChatTemplate};
use std::io::Write;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text (special tokens like `<|im_start|>` are recognised).
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print one JSON object (prompt_ids, output_ids, text, first_step_top5) instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    let path = args.model.prepare()?;
    let loaded = model_args::load(&path)?;
    let tokenizer = &loaded.tokenizer;
    let prompt = if args.chat {
        ChatTemplate::from_tokenizer(tokenizer)?
            .render(&[ChatMessage::new("user", args.prompt.as_str())], true)?
    } else {
        args.prompt.clone()
    };
    let prompt_ids = tokenizer.encode(&prompt, true)?;
    if prompt_ids.is_empty() {
        bail!("the prompt is empty");
    }
    let defaults = EngineConfig::default();
    let needed = (prompt_ids.len() + args.max_tokens as usize).min(loaded.model.config.max_context);
    let engine_config = EngineConfig {
        // Just enough KV for this one sequence.
        num_blocks: needed.div_ceil(defaults.block_size) + 1,
        max_num_seqs: 1,
        enable_prefix_caching: false,
        ..defaults
    };
    let mut engine = engine_config.llama_engine(&loaded)?;
    let params = SamplingParams {
        temperature: args.temperature,
        seed: args.seed,
        max_tokens: args.max_tokens,
        ..SamplingParams::default()
    };
    engine
        .add_request(0, prompt_ids.clone(), params, 5)
        .context("starting generation")?;

    let mut output_ids = Vec::new();
    let mut text = String::new();
    let mut first_step_top5 = None;
    let mut stdout = std::io::stdout().lock();
    while engine.has_work() {
        for out in engine.step()? {
            if let Some(s) = &out.sampled {
                output_ids.push(s.token);
            }
            first_step_top5.get_or_insert(out.top_logits);
            text.push_str(&out.text);
            if !args.json {
                stdout.write_all(out.text.as_bytes())?;
                stdout.flush()?;
            }
        }
    }
    if args.json {
        let top5 = first_step_top5.unwrap_or_default();
        let json = serde_json::json!({
            "prompt_ids": prompt_ids,
            "output_ids": output_ids,
            "text": text,
            "first_step_top5": {
                "ids": top5.iter().map(|(id, _)| id).collect::<Vec<_>>(),
                "logits": top5.iter().map(|(_, l)| l).collect::<Vec<_>>(),
            },
        });
        writeln!(stdout, "{json}")?;
    } else {
        writeln!(stdout)?;
    }
    Ok(())
}
