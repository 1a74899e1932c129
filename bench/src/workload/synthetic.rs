//! `synthetic:` workloads: drawn lengths, content of no note.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::azure::bundled_azure;
use super::spec::{Length, SyntheticSpec};
use super::text::PromptMaker;
use super::{scaled, WorkItem, WorkloadError, WorkloadOptions};
use crate::arrivals::normal;

/// Seeds lengths apart from content, so a different input length leaves the output
/// lengths of the same seed unchanged.
const LENGTH_STREAM: u64 = 0x6c65_6e67_7468_7301;

pub(super) fn items(
    spec: &SyntheticSpec,
    opts: &WorkloadOptions,
) -> Result<Vec<WorkItem>, WorkloadError> {
    let pairs = if spec.input == Length::Azure || spec.output == Length::Azure {
        bundled_azure()?
    } else {
        Vec::new()
    };
    let mut rng = StdRng::seed_from_u64(opts.seed ^ LENGTH_STREAM);
    let mut maker = PromptMaker::new(opts.api, opts.seed, opts.token_ids.clone(), spec.prefix);
    let scale = spec.scale.unwrap_or(1.0);
    Ok((0..opts.requests)
        .map(|_| {
            // One row per request, shared by both lengths when both are azure.
            let row = (!pairs.is_empty()).then(|| pairs[rng.gen_range(0..pairs.len())]);
            let input = draw(spec.input, &mut rng, || {
                scaled(row.map_or(1, |r| r.context_tokens), scale)
            });
            let output = draw(spec.output, &mut rng, || {
                scaled(row.map_or(1, |r| r.generated_tokens), scale)
            });
            let input = spec.max_input.map_or(input, |m| input.min(m));
            let output = spec.max_output.map_or(output, |m| output.min(m));
            WorkItem {
                prompt: maker.make(input),
                max_tokens: opts.cap_output(output),
                at: None,
                previous_turn: None,
                hash_ids: Vec::new(),
            }
        })
        .collect())
}

/// One length from `length`; `azure` is the row's (already drawn) value.
fn draw(length: Length, rng: &mut StdRng, azure: impl FnOnce() -> u32) -> u32 {
    match length {
        Length::Fixed(n) => n,
        Length::Uniform { min, max } => rng.gen_range(min..=max),
        Length::Normal { mean, sd } => (mean + sd * normal(rng))
            .round()
            .clamp(1.0, f64::from(u32::MAX)) as u32,
        Length::Azure => azure(),
    }
}
