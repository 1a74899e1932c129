use super::*;

/// Everything the parser gives for `pieces` streamed in order, then finished.
fn parse(pieces: &[&str]) -> Vec<Found> {
    let mut p = CallParser::default();
    let mut out = Vec::new();
    for piece in pieces {
        out.extend(p.push(piece));
    }
    out.extend(p.finish());
    out
}

/// The content and the calls (name, joined arguments) the events add up to.
fn join(found: &[Found]) -> (String, Vec<(String, String)>) {
    let mut text = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    for f in found {
        match f {
            Found::Text(t) => text.push_str(t),
            Found::CallStart { index, name } => {
                assert_eq!(*index, calls.len(), "calls are numbered in order");
                calls.push((name.clone(), String::new()));
            }
            Found::Arguments { index, piece } => calls[*index].1.push_str(piece),
        }
    }
    (text, calls)
}

/// `text` cut into pieces of `n` bytes (at character boundaries).
fn pieces(text: &str, n: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + n).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.push(&text[start..end]);
        start = end;
    }
    out
}

const TWO_CALLS: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2], \"opts\": {\"unit\": \"c}\"}}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";

#[test]
fn calls_parse_the_same_however_the_text_is_cut() {
    let want = (
        "Let me check.\n".to_string(),
        vec![
            (
                "get_weather".to_string(),
                "{\"city\": \"Paris\", \"days\": [1, 2], \"opts\": {\"unit\": \"c}\"}}".to_string(),
            ),
            ("time".to_string(), "{}".to_string()),
        ],
    );
    for n in [1, 2, 3, 5, 7, 11, 64, TWO_CALLS.len()] {
        let found = parse(&pieces(TWO_CALLS, n));
        assert_eq!(join(&found), want, "pieces of {n}");
        for f in &found {
            if let Found::Text(t) = f {
                assert!(!t.contains('<'), "no markup leaks into the text: {t:?}");
            }
        }
    }
}

#[test]
fn arguments_stream_before_the_call_ends() {
    let mut p = CallParser::default();
    let mut out = p.push("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": ");
    assert_eq!(
        out,
        vec![
            Found::CallStart {
                index: 0,
                name: "f".into()
            },
            Found::Arguments {
                index: 0,
                piece: "{\"a\":".into()
            }
        ]
    );
    // The closing brace may be the call's own (and trailing space may precede it): held
    // back until the block closes.
    out = p.push("1}");
    assert_eq!(
        out,
        vec![Found::Arguments {
            index: 0,
            piece: " 1".into()
        }]
    );
    out = p.push("}\n</tool_");
    assert_eq!(out, vec![]);
    out = p.push("call>");
    assert_eq!(
        out,
        vec![Found::Arguments {
            index: 0,
            piece: "}".into()
        }]
    );
    assert!(p.found_calls());
    assert_eq!(p.finish(), vec![]);
}

#[test]
fn text_that_only_looks_like_a_call_stays_text() {
    // Held back while it could be `<tool_call>`, given once it cannot.
    let mut p = CallParser::default();
    assert_eq!(p.push("a <tool"), vec![Found::Text("a ".into())]);
    assert_eq!(p.push("s>"), vec![Found::Text("<tools>".into())]);
    // A block that is not a call: given back as written.
    let bad = "x <tool_call>not json</tool_call> y";
    assert_eq!(join(&parse(&pieces(bad, 3))), (bad.to_string(), vec![]));
    assert!(!CallParser::default().found_calls());
    // Cut off before the name is known: text.
    let cut = "<tool_call>\n{\"na";
    assert_eq!(join(&parse(&[cut])), (cut.to_string(), vec![]));
}

#[test]
fn a_call_cut_short_keeps_what_was_written() {
    let found = parse(&pieces(
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2",
        4,
    ));
    assert_eq!(
        join(&found),
        (String::new(), vec![("f".into(), "{\"a\": [1, 2".into())])
    );
}

#[test]
fn string_arguments_are_unwrapped_and_key_order_is_free() {
    let text = "<tool_call>{\"arguments\": \"{\\\"q\\\": 1}\", \"name\": \"g\"}</tool_call>";
    for n in [1, 4, text.len()] {
        assert_eq!(
            join(&parse(&pieces(text, n))),
            (String::new(), vec![("g".into(), "{\"q\": 1}".into())])
        );
    }
}

#[test]
fn past_calls_and_results_render_in_the_call_format() {
    let text = assistant_text(
        "ok",
        &[
            PastCall {
                name: "f".into(),
                arguments: "{\"a\": 1}".into(),
            },
            PastCall {
                name: "g".into(),
                arguments: "not json".into(),
            },
        ],
    );
    assert_eq!(
        text,
        "ok\n<tool_call>\n{\"name\":\"f\",\"arguments\":{\"a\":1}}\n</tool_call>\n\
         <tool_call>\n{\"name\":\"g\",\"arguments\":\"not json\"}\n</tool_call>"
    );
    // What the model wrote parses back to the same calls.
    let (content, calls) = join(&parse(&[&text]));
    assert_eq!(content, "ok\n");
    assert_eq!(
        calls,
        vec![
            ("f".to_string(), "{\"a\":1}".to_string()),
            ("g".to_string(), "not json".to_string())
        ]
    );

    let mut messages = vec![ChatMessage::new("assistant", text)];
    push_result(&mut messages, "12 C", false);
    push_result(&mut messages, "noon", true);
    assert_eq!(
        messages[1],
        ChatMessage::new(
            "user",
            "<tool_response>\n12 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
        )
    );
}

fn tools(choice: ToolChoice, parallel: bool) -> Tools {
    Tools {
        tools: vec![
            Tool {
                name: "get_weather".into(),
                description: Some("Weather".into()),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
            },
            Tool {
                name: "time".into(),
                description: None,
                parameters: json!({"type": "object", "properties": {}}),
            },
        ],
        choice,
        parallel,
    }
}

#[test]
fn the_system_message_lists_every_tool() {
    let t = tools(ToolChoice::Auto, true);
    let shown = t.show(vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "hi"),
    ]);
    assert_eq!(shown.len(), 2);
    assert!(shown[0].content.starts_with("Be brief.\n\n# Tools"));
    assert!(shown[0].content.contains(
        "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather\""
    ));
    assert!(shown[0]
        .content
        .contains("\"name\":\"time\",\"parameters\""));
    let shown = t.show(vec![ChatMessage::new("user", "hi")]);
    assert_eq!(shown[0].role, "system");
    assert_eq!(shown[1], ChatMessage::new("user", "hi"));
}

#[test]
fn only_required_and_named_calls_are_constrained() {
    assert_eq!(tools(ToolChoice::Auto, true).constraint(), None);
    assert_eq!(tools(ToolChoice::None, true).constraint(), None);
    let Some(Constraint::Grammar { lark }) = tools(ToolChoice::Required, false).constraint() else {
        panic!("a grammar")
    };
    assert!(lark.starts_with("start: call\n"), "{lark}");
    assert!(lark.contains("(f0 | f1)"), "{lark}");
    let Some(Constraint::Grammar { lark }) =
        tools(ToolChoice::Named("time".into()), true).constraint()
    else {
        panic!("a grammar")
    };
    assert!(lark.starts_with("start: call (\"\\n\" call)*\n"), "{lark}");
    assert!(lark.contains("\"const\":\"time\"") && !lark.contains("get_weather"));
}

#[test]
fn tool_choice_and_names_are_checked() {
    let api = Api::Chat;
    assert_eq!(
        tool_choice(api, json!({"type": "function", "function": {"name": "f"}})).unwrap(),
        ToolChoice::Named("f".into())
    );
    assert_eq!(
        tool_choice(Api::Responses, json!({"type": "function", "name": "f"})).unwrap(),
        ToolChoice::Named("f".into())
    );
    assert_eq!(
        tool_choice(api, json!("required")).unwrap(),
        ToolChoice::Required
    );
    assert!(tool_choice(api, json!("always")).is_err());
    assert!(tool_choice(api, json!({"type": "function", "name": "f"})).is_err());
    assert!(matches!(
        tool_choice(api, json!({"type": "web_search"})),
        Err(ApiError::UnsupportedParameter { .. })
    ));
    assert!(check_name("n", "get_weather-2").is_ok());
    for bad in ["", "has space", "ünï", &"x".repeat(65)] {
        assert_eq!(
            check_name("n", bad).unwrap_err().param(),
            Some("n"),
            "{bad:?}"
        );
    }
    let chat = tool(
        Api::Chat,
        0,
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
    )
    .unwrap();
    let responses = tool(
        Api::Responses,
        0,
        json!({"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}),
    )
    .unwrap();
    assert_eq!(chat, responses);
    assert_eq!(
        tool(
            Api::Chat,
            3,
            json!({"type": "function", "function": {"name": "f", "parameters": 3}})
        )
        .unwrap_err()
        .param(),
        Some("tools[3].function.parameters")
    );
    assert!(matches!(
        tool(Api::Chat, 0, json!({"type": "code_interpreter"})),
        Err(ApiError::UnsupportedParameter { .. })
    ));
}
