//! `docs/configuration.md`, written from the code: every role's keys, flags and variables,
//! and every variable kvmesh reads. A test keeps the file in step.

use super::env_vars::ALL;
use super::{key_of, role_command, Layered};
use crate::node::config::{DecodeNodeConfig, PrefillNodeConfig, RouterNodeConfig};
use crate::serve::ServeConfig;
use std::fmt::Write;

const INTRO: &str = "\
# Configuration

<!-- Written by `cargo test --release -p kvmesh --bins write_docs_configuration -- --ignored`
     from the code; a test fails when it is out of date. -->

`kvmesh serve`, `router`, `prefill` and `decode` read their settings in layers, each one
overriding the one before:

1. the built-in defaults,
2. a TOML file given with `--config PATH` (or `KVMESH_CONFIG`); a key the role does not know is
   an error,
3. `KVMESH_*` environment variables,
4. command-line flags.

`--print-config` prints the merged configuration as TOML and exits (API keys masked); the output
is itself a valid `--config` file. A bad value is reported with where it came from: the file,
the variable or the flag.
";

/// The whole document.
pub fn document() -> String {
    let mut out = String::from(INTRO);
    out.push_str("\n## Environment variables\n\n| Variable | Sets |\n|---|---|\n");
    for var in ALL {
        let _ = writeln!(out, "| `{}` | {} |", var.name, cell(var.doc));
    }
    role::<ServeConfig>(&mut out, "the whole mesh in one process");
    role::<RouterNodeConfig>(&mut out, "the HTTP API of a multi-process mesh");
    role::<PrefillNodeConfig>(&mut out, "a prefill node");
    role::<DecodeNodeConfig>(&mut out, "a decode node");
    out
}

fn role<C: Layered>(out: &mut String, what: &str) {
    let defaults = super::defaults_of::<C>();
    let _ = write!(
        out,
        "\n## `kvmesh {}`: {what}\n\n| TOML key | Flag | Variable | Default | Meaning |\n\
         |---|---|---|---|---|\n",
        C::ROLE
    );
    let mut flag_keys = Vec::new();
    for arg in role_command::<C>().get_arguments() {
        let (id, Some(long)) = (arg.get_id().as_str(), arg.get_long()) else {
            continue;
        };
        let key = if matches!(id, "config" | "print_config") {
            "".to_string()
        } else {
            key_of::<C>(id).to_string()
        };
        let env = arg
            .get_env()
            .map_or(String::new(), |e| format!("`{}`", e.to_string_lossy()));
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let key_cell = if key.is_empty() {
            String::new()
        } else {
            format!("`{key}`")
        };
        let _ = writeln!(
            out,
            "| {key_cell} | `--{long}` | {env} | {} | {} |",
            default_of::<C>(&defaults, &key),
            cell(&help)
        );
        flag_keys.push(key);
    }
    let mut leaves = Vec::new();
    super::leaf_keys("", &defaults, &mut leaves);
    leaves.extend(C::UNSET_KEYS.iter().map(|k| k.to_string()));
    for key in leaves.iter().filter(|k| !flag_keys.contains(k)) {
        let _ = writeln!(
            out,
            "| `{key}` | | | {} | (file only) |",
            default_of::<C>(&defaults, key)
        );
    }
}

/// A key's default as the table shows it.
fn default_of<C: Layered>(defaults: &toml::Table, key: &str) -> String {
    if key.is_empty() {
        return String::new();
    }
    if let Some((_, note)) = C::MACHINE_DEFAULTS.iter().find(|(k, _)| *k == key) {
        return cell(note);
    }
    match super::value_at(defaults, key) {
        None => "unset".into(),
        Some(toml::Value::Table(_)) => format!("see `{key}.*`"),
        Some(v) => format!("`{}`", cell(&v.to_string())),
    }
}

/// Text fit for one table cell.
fn cell(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::env_vars;

    const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md");

    #[test]
    fn docs_configuration_md_matches_the_code() {
        let written = std::fs::read_to_string(PATH).unwrap_or_default();
        assert!(
            written == document(),
            "docs/configuration.md is out of date: run `cargo test --release -p kvmesh --bins \
             write_docs_configuration -- --ignored`"
        );
    }

    #[test]
    #[ignore = "writes docs/configuration.md"]
    fn write_docs_configuration() {
        std::fs::write(PATH, document()).unwrap();
    }

    fn check_role<C: Layered>() {
        for arg in role_command::<C>().get_arguments() {
            if let Some(name) = arg.get_env() {
                assert!(
                    env_vars::ALL.iter().any(|v| name == v.name),
                    "{name:?} is missing from env_vars::ALL"
                );
            }
            let id = arg.get_id().as_str();
            if matches!(id, "config" | "print_config" | "help") {
                continue;
            }
            // A key the role's TOML does not know fails as an unknown field; a known one
            // at most as a wrong type, or an unknown variant, for this probe value.
            let mut table = toml::Table::new();
            super::super::set_key(&mut table, key_of::<C>(id), toml::Value::from("probe"));
            if let Err(e) = toml::Value::Table(table).try_into::<C>() {
                assert!(
                    !e.to_string().contains("unknown field"),
                    "--{id} of {} sets an unknown key: {e}",
                    C::ROLE
                );
            }
        }
    }

    #[test]
    fn every_flag_names_a_listed_variable_and_a_key_of_its_role() {
        check_role::<ServeConfig>();
        check_role::<RouterNodeConfig>();
        check_role::<PrefillNodeConfig>();
        check_role::<DecodeNodeConfig>();
        let mut names: Vec<_> = env_vars::ALL.iter().map(|v| v.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(
            names.len(),
            env_vars::ALL.len(),
            "a variable is listed twice"
        );
    }
}
