//! Layered configuration, one mechanism for every role (`serve`, `router`, `prefill`,
//! `decode`): defaults < TOML file (`--config`, `KVMESH_CONFIG`) < `KVMESH_*` environment <
//! flags, and `--print-config` to see the result.
//!
//! A role is a [`Layered`] type: its TOML shape, and its clap flags ([`Layered::Args`], every
//! one optional, so an unset flag leaves the layer below alone). A layer's flags are serialized
//! into the TOML shape, each at the key [`Layered::KEYS`] names, and the merged table is
//! deserialized once: a flag and the key it overrides cannot read a value differently.
//! Environment variables are parsed by the same flag definitions, one at a time, so an error
//! names the variable. Clap itself never reads the environment here: the caller passes it in,
//! which lets tests give an explicit map.

pub mod env_vars;
#[cfg(test)]
mod reference;

use anyhow::{anyhow, Context, Result};
use clap::{Args, Command, FromArgMatches};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

/// The environment as the layers see it: variable name to value.
pub type EnvMap = BTreeMap<String, String>;

/// The process's `KVMESH_*` variables; warns about those kvmesh does not read (a typo would
/// otherwise be ignored in silence).
pub fn process_env() -> EnvMap {
    let env: EnvMap = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .filter(|(k, _)| k.starts_with("KVMESH_"))
        .collect();
    for name in env.keys() {
        if !env_vars::ALL.iter().any(|v| v.name == name) {
            tracing::warn!(
                "{name} is not a variable kvmesh reads (docs/configuration.md lists them)"
            );
        }
    }
    env
}

/// `--config` and `--print-config`, which every layered role takes.
#[derive(Args, Clone, Debug, Default)]
pub struct ConfigArgs {
    /// TOML file with any of the settings (KVMESH_* variables and flags override it).
    #[arg(long, env = env_vars::CONFIG)]
    pub config: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit (`--config` accepts the output).
    #[arg(long)]
    pub print_config: bool,
}

/// One role's configuration: the TOML shape (`Self`) and the flags that override it.
pub trait Layered: Default + Serialize + DeserializeOwned {
    /// The subcommand's name.
    const ROLE: &'static str;
    /// Flags whose TOML key is not their own name: tables of (flag field, dotted TOML key).
    const KEYS: &'static [&'static [(&'static str, &'static str)]];
    /// Defaults that depend on the machine, described instead of shown: (key, description).
    const MACHINE_DEFAULTS: &'static [(&'static str, &'static str)] = &[];
    /// Keys unset by default that no flag sets (the default TOML omits them).
    #[cfg_attr(not(test), allow(dead_code))] // read for docs/configuration.md
    const UNSET_KEYS: &'static [&'static str] = &[];

    type Args: clap::Args + clap::FromArgMatches + Serialize;

    fn config_args(args: &Self::Args) -> &ConfigArgs;
    /// Normalizes and checks the merged values.
    fn finish(&mut self) -> Result<(), Invalid>;
    /// What running (beyond printing) also needs: settings that have no default.
    fn require(&self) -> Result<(), Invalid> {
        Ok(())
    }
    /// The configuration as `--print-config` shows it (secrets masked).
    fn redacted(&self) -> Self;
}

/// A setting that fails a check: its dotted TOML key and what is wrong.
#[derive(Debug, PartialEq)]
pub struct Invalid {
    pub key: String,
    pub reason: String,
}

impl Invalid {
    pub fn new(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

/// Where a setting's value came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    File(PathBuf),
    Env(String),
    Flag(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::File(path) => write!(f, "{}", path.display()),
            Source::Env(name) | Source::Flag(name) => f.write_str(name),
        }
    }
}

/// The role's flags as clap parses them, with the environment left out: it is a layer of its
/// own. Help still names each flag's variable.
pub fn without_env(command: Command) -> Command {
    command.mut_args(|arg| {
        let Some(name) = arg.get_env().map(|n| n.to_string_lossy().into_owned()) else {
            return arg;
        };
        let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
        let long_help = arg.get_long_help().map(ToString::to_string);
        let arg = arg.env(None).help(format!("{help} [env: {name}]"));
        match long_help {
            Some(long) => arg.long_help(format!("{long} [env: {name}]")),
            None => arg,
        }
    })
}

/// Subcommand `C::ROLE` of `cli` with [`role_flags`].
pub fn layered<C: Layered>(cli: Command) -> Command {
    cli.mut_subcommand(C::ROLE, role_flags::<C>)
}

/// The role's flags as they are parsed: [`without_env`], and each flag's help ends with the
/// default it leaves in place (read from `C::default()`, so help cannot drift from it).
pub fn role_flags<C: Layered>(command: Command) -> Command {
    let defaults = defaults_of::<C>();
    without_env(command).mut_args(|arg| {
        let key = key_of::<C>(arg.get_id().as_str());
        let shown = match C::MACHINE_DEFAULTS.iter().find(|(k, _)| *k == key) {
            Some((_, note)) => note.to_string(),
            None => match value_at(&defaults, key) {
                Some(toml::Value::String(s)) => s.clone(),
                Some(toml::Value::Table(_)) | None => return arg,
                Some(toml::Value::Array(a)) if a.is_empty() => return arg,
                Some(v) => v.to_string(),
            },
        };
        let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
        arg.help(format!("{help} [default: {shown}]"))
    })
}

/// `C::default()` as a TOML table.
pub fn defaults_of<C: Layered>() -> toml::Table {
    match toml::Value::try_from(C::default()) {
        Ok(toml::Value::Table(t)) => t,
        _ => toml::Table::new(),
    }
}

/// The value at dotted `key`.
pub fn value_at<'t>(table: &'t toml::Table, key: &str) -> Option<&'t toml::Value> {
    let (head, rest) = match key.split_once('.') {
        Some((head, rest)) => (head, Some(rest)),
        None => (key, None),
    };
    let value = table.get(head)?;
    match (rest, value) {
        (None, v) => Some(v),
        (Some(rest), toml::Value::Table(inner)) => value_at(inner, rest),
        (Some(_), _) => None,
    }
}

fn role_command<C: Layered>() -> Command {
    C::Args::augment_args(Command::new(C::ROLE).no_binary_name(true))
}

#[cfg(test)]
/// Parses `argv` (the role's arguments, without the program and subcommand) and layers it
/// over `env`, the file and the defaults.
pub fn parse<C: Layered>(argv: &[&str], env: &EnvMap) -> Result<C> {
    let matches = role_flags::<C>(role_command::<C>())
        .try_get_matches_from(argv)
        .map_err(|e| anyhow!("{}", first_line(&e)))?;
    let flags = C::Args::from_arg_matches(&matches)?;
    load(&flags, env)
}

/// Runs a role: loads its configuration, prints it for `--print-config`, else checks that it
/// is complete and calls `start`.
pub fn run<C: Layered>(
    flags: &C::Args,
    env: &EnvMap,
    start: impl FnOnce(&C) -> Result<()>,
) -> Result<()> {
    let config = load::<C>(flags, env)?;
    if C::config_args(flags).print_config {
        print!("{}", toml::to_string_pretty(&config.redacted())?);
        return Ok(());
    }
    config
        .require()
        .map_err(|e| anyhow!("{} {}", e.key, e.reason))?;
    start(&config)
}

/// Defaults < the file < `env` < `flags`, merged and checked.
pub fn load<C: Layered>(flags: &C::Args, env: &EnvMap) -> Result<C> {
    let env_layers = env_layers::<C>(env)?;
    let path = C::config_args(flags).config.clone().or_else(|| {
        env_layers
            .iter()
            .find_map(|(_, args)| C::config_args(args).config.clone())
    });
    let mut layers = Layers::default();
    if let Some(path) = path {
        layers.file(&path, read_file::<C>(&path)?);
    }
    for (name, args) in &env_layers {
        layers.overlay::<C>(args, |_| Source::Env(name.clone()))?;
    }
    let command = role_command::<C>();
    layers.overlay::<C>(flags, |field| {
        let long = command
            .get_arguments()
            .find(|a| a.get_id() == field)
            .and_then(|a| a.get_long())
            .unwrap_or(field);
        Source::Flag(format!("--{long}"))
    })?;
    let mut config: C = toml::Value::Table(std::mem::take(&mut layers.merged))
        .try_into()
        .context("merging the configuration layers")?;
    config.finish().map_err(|e| {
        let source = layers.source_of(&e.key);
        anyhow!("{} {} ({})", e.key, e.reason, source)
    })?;
    Ok(config)
}

/// The file's table, checked against the role's shape first so that an unknown key or a
/// wrong type is reported with the file's name and the line.
fn read_file<C: Layered>(path: &std::path::Path) -> Result<toml::Table> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str::<C>(&text).with_context(|| format!("in {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("in {}", path.display()))
}

/// One `C::Args` per environment variable that is set (empty counts as unset), each holding
/// just that variable's flag.
fn env_layers<C: Layered>(env: &EnvMap) -> Result<Vec<(String, C::Args)>> {
    // Built with env names (clap reads the process environment here, but nothing parses it).
    let named = role_command::<C>();
    let parser = without_env(named.clone());
    let mut layers = Vec::new();
    for arg in named.get_arguments() {
        let (Some(name), Some(long)) = (arg.get_env(), arg.get_long()) else {
            continue;
        };
        let name = name.to_string_lossy().into_owned();
        let Some(value) = env.get(&name).filter(|v| !v.is_empty()) else {
            continue;
        };
        let matches = parser
            .clone()
            .try_get_matches_from([format!("--{long}={value}")])
            .map_err(|e| anyhow!("{name}: {}", first_line(&e)))?;
        layers.push((name, C::Args::from_arg_matches(&matches)?));
    }
    Ok(layers)
}

/// Clap's message without the usage and help lines.
fn first_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let line = text.lines().next().unwrap_or_default();
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

/// The merged table and where each key in it came from (later entries win).
#[derive(Default)]
struct Layers {
    merged: toml::Table,
    sources: Vec<(String, Source)>,
}

impl Layers {
    fn file(&mut self, path: &std::path::Path, table: toml::Table) {
        let mut keys = Vec::new();
        leaf_keys("", &table, &mut keys);
        for key in keys {
            self.sources.push((key, Source::File(path.to_path_buf())));
        }
        self.merged = table;
    }

    /// Sets every flag given in `args` at its key, replacing what the lower layers put there.
    fn overlay<C: Layered>(
        &mut self,
        args: &C::Args,
        source: impl Fn(&str) -> Source,
    ) -> Result<()> {
        let toml::Value::Table(given) = toml::Value::try_from(args)? else {
            return Err(anyhow!("flags of {} do not serialize as a table", C::ROLE));
        };
        for (field, value) in given {
            let key = key_of::<C>(&field);
            set_key(&mut self.merged, key, value);
            self.sources.push((key.to_string(), source(&field)));
        }
        Ok(())
    }

    /// The layer that set `key` (or a key inside it, or the table holding it).
    fn source_of(&self, key: &str) -> String {
        let within =
            |outer: &str, inner: &str| inner == outer || inner.starts_with(&format!("{outer}."));
        self.sources
            .iter()
            .rev()
            .find(|(k, _)| within(k, key) || within(key, k))
            .map_or_else(|| "the default".to_string(), |(_, s)| format!("from {s}"))
    }
}

/// The TOML key that flag `field` sets.
pub fn key_of<C: Layered>(field: &str) -> &str {
    C::KEYS
        .iter()
        .flat_map(|table| table.iter())
        .find(|(f, _)| *f == field)
        .map_or(field, |(_, key)| key)
}

/// Sets dotted `key` in `table`, making the tables on its way.
pub fn set_key(table: &mut toml::Table, key: &str, value: toml::Value) {
    match key.split_once('.') {
        None => {
            table.insert(key.to_string(), value);
        }
        Some((head, rest)) => {
            let inner = table
                .entry(head)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if !inner.is_table() {
                *inner = toml::Value::Table(toml::Table::new());
            }
            if let toml::Value::Table(inner) = inner {
                set_key(inner, rest, value);
            }
        }
    }
}

/// Every non-table value's dotted key.
fn leaf_keys(prefix: &str, table: &toml::Table, out: &mut Vec<String>) {
    for (k, v) in table {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(inner) => leaf_keys(&key, inner, out),
            _ => out.push(key),
        }
    }
}

/// Serde for an optional node id as the hex string `--node-id` takes.
pub mod node_id_hex {
    use kvmesh_common::NodeId;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn parse(s: &str) -> Result<NodeId, String> {
        u64::from_str_radix(s.trim_start_matches("0x"), 16)
            .map(NodeId)
            .map_err(|e| format!("node id must be hex: {e}"))
    }

    pub fn serialize<S: Serializer>(id: &Option<NodeId>, s: S) -> Result<S::Ok, S::Error> {
        match id {
            Some(id) => s.serialize_str(&format!("{:x}", id.0)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<NodeId>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| parse(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
pub mod testing {
    //! Helpers for the per-role layering tests.

    use super::EnvMap;
    use std::io::Write;

    pub fn env(vars: &[(&str, &str)]) -> EnvMap {
        vars.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// A TOML file holding `text`, deleted when dropped.
    pub fn toml_file(text: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        file
    }
}
