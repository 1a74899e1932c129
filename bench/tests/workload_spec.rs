//! The workload grammar: specs parse, write back to themselves, and name the part at fault.

use std::path::PathBuf;

use kvmesh_bench::workload::{Length, SyntheticSpec, WorkloadSpec};

fn parse(s: &str) -> WorkloadSpec {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

#[test]
fn specs_round_trip_through_display() {
    for s in [
        "synthetic:input=128,output=64",
        "synthetic:input=uniform(64,512),output=normal(256,64.5),prefix=32",
        "synthetic:input=azure,output=azure,scale=2.5,max_input=4000,max_output=300",
        "synthetic:input=azure,output=16,scale=4",
        "jsonl:/tmp/prompts.jsonl",
        "sharegpt:data/ShareGPT_V3.json",
        "mooncake,scale=16",
        "mooncake:/data/trace.jsonl,scale=4,conversations=20",
        "mooncake,scale=8,conversations=3",
        "azure",
        "azure:/data/azure.csv,scale=2",
    ] {
        let spec = parse(s);
        assert_eq!(spec.to_string(), s, "written back as given");
        assert_eq!(parse(&spec.to_string()), spec);
    }
}

#[test]
fn defaults_and_spacing() {
    assert_eq!(
        parse(" synthetic: output = uniform( 1 , 9 ) , input=7 "),
        WorkloadSpec::Synthetic(SyntheticSpec {
            input: Length::Fixed(7),
            output: Length::Uniform { min: 1, max: 9 },
            prefix: None,
            scale: None,
            max_input: None,
            max_output: None,
        })
    );
    assert_eq!(
        parse("mooncake"),
        WorkloadSpec::Mooncake {
            path: None,
            scale: 16,
            conversations: None
        }
    );
    assert_eq!(parse("mooncake:scale=4"), parse("mooncake,scale=4"));
    assert_eq!(
        parse("azure:trace.csv"),
        WorkloadSpec::Azure {
            path: Some(PathBuf::from("trace.csv")),
            scale: 1.0
        }
    );
    assert_eq!(
        parse("jsonl:a,b.jsonl"),
        WorkloadSpec::Jsonl("a,b.jsonl".into()),
        "a file path runs to the end"
    );
}

#[test]
fn errors_name_the_part_at_fault() {
    let cases = [
        ("poisson:rate=3", "poisson", "unknown source"),
        ("synthetic:input=128", "input=128", "missing output="),
        ("synthetic:input=0,output=4", "0", "expected a length"),
        (
            "synthetic:input=uniform(9,2),output=4",
            "uniform(9,2)",
            "minimum is above",
        ),
        (
            "synthetic:input=uniform(9),output=4",
            "uniform(9)",
            "expected uniform(A,B)",
        ),
        (
            "synthetic:input=normal(5,-1),output=4",
            "-1",
            "standard deviation",
        ),
        (
            "synthetic:input=zipf(1,2),output=4",
            "zipf",
            "unknown distribution",
        ),
        (
            "synthetic:input=4,output=4,scale=2",
            "2",
            "neither length is azure",
        ),
        (
            "synthetic:input=4,output=4,input=5",
            "input=5",
            "given twice",
        ),
        (
            "synthetic:input=4,output=4,colour=red",
            "colour=red",
            "unknown key",
        ),
        ("synthetic:input=4,output=4,prefix=0", "0", "at least 1"),
        (
            "synthetic:input=4,output=4,junk",
            "junk",
            "expected key=value",
        ),
        ("jsonl", "jsonl", "expected jsonl:PATH"),
        ("sharegpt:", "sharegpt:", "expected sharegpt:PATH"),
        ("mooncake,scale=3", "3", "must divide 512"),
        ("mooncake:t.jsonl,conversations=0", "0", "at least 1"),
        ("azure,scale=-1", "-1", "positive number"),
        (
            "azure:x.csv,speed=2",
            "speed=2",
            "unknown key (expected scale)",
        ),
    ];
    for (spec, part, problem) in cases {
        let e = spec.parse::<WorkloadSpec>().unwrap_err();
        assert_eq!(e.part, part, "{spec}: {e}");
        assert!(e.problem.contains(problem), "{spec}: {e}");
        assert!(e.to_string().starts_with("workload: `"), "{e}");
    }
}
