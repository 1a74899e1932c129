//! The text metadata of the real SmolLM2 GGUF, read without its weights.

use std::path::{Path, PathBuf};

use kvmesh_prompt::chat_template::{ChatMessage, ChatTemplate};
use kvmesh_prompt::{ModelFileError, ModelFiles, ModelText};

fn model_path() -> PathBuf {
    kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn smollm2_text_metadata() {
    let path = model_path();
    assert_eq!(
        ModelFiles::locate(&path).unwrap(),
        ModelFiles::Gguf(path.clone())
    );
    let text = ModelText::read(&path).unwrap();
    assert_eq!(text.max_context, 8192);
    let tok = &text.tokenizer;
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!((tok.bos_token_id(), tok.eos_token_id()), (Some(1), Some(2)));
    let template = ChatTemplate::from_tokenizer(tok).expect("SmolLM2 has a chat template");
    let prompt = template
        .render(&[ChatMessage::new("user", "Hi")], true)
        .unwrap();
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
    // A pure function of the file.
    assert_eq!(
        ModelText::read(&path).unwrap().fingerprint,
        text.fingerprint
    );
}

#[test]
fn files_that_are_no_model_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, b"hello").unwrap();
    assert!(matches!(
        ModelText::read(&notes),
        Err(ModelFileError::UnknownFormat { path }) if path == notes
    ));
    // A directory without weights is no checkpoint.
    assert!(matches!(
        ModelText::read(dir.path()),
        Err(ModelFileError::UnknownFormat { .. })
    ));
    let missing = Path::new("/nonexistent/model.gguf");
    let err = ModelText::read(missing).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/model.gguf"), "{err}");
}
