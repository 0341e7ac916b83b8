//! FASTA and A3M parsing: records, normalisation, deletion counts and every error message.
use std::path::Path;

use data::{a3m, fasta};

fn src() -> &'static Path {
    Path::new("input.fa")
}

fn fasta_err(text: &str) -> String {
    fasta::parse(text, src()).unwrap_err().to_string()
}

#[test]
fn fasta_records_are_named_cleaned_and_upper_cased() {
    let text = ">query one two\nmkt ay\nIAK\n\n>second\r\nGG  GB\nzuoj\n";
    let recs = fasta::parse(text, src()).unwrap();
    assert_eq!(recs.len(), 2);
    assert_eq!(recs[0].name, "query");
    assert_eq!(recs[0].description, "query one two");
    assert_eq!(recs[0].sequence, "MKTAYIAK");
    assert_eq!(recs[1].name, "second");
    // Kept as written, as AlphaFold keeps them (the old reader turned them into X).
    assert_eq!(recs[1].sequence, "GGGBZUOJ", "B Z U O J kept");
}

#[test]
fn fasta_errors_name_file_record_position_and_character() {
    let err = fasta_err(">a\nMK\nT*A\n");
    assert!(err.starts_with("input.fa: "), "{err}");
    assert!(err.contains("record \"a\", position 4 (line 3): '*' is not an amino-acid code"), "{err}");
    let err = fasta_err(">a\nMK1\n");
    assert!(err.contains("position 3") && err.contains("'1'"), "{err}");
    assert!(fasta_err(">a\n>b\nMK\n").contains("record \"a\" has an empty sequence"));
    assert!(fasta_err(">a\nMK\n>b\n\n").contains("record \"b\" has an empty sequence"));
    assert!(fasta_err("MKT\n>a\nMK\n").contains("line 1: sequence data before the first '>' header"));
    assert!(fasta_err(">a\nMK\n>a desc\nGG\n").contains("line 3: duplicate record name \"a\""));
    assert!(fasta_err("").contains("no FASTA records"));
    assert!(fasta_err("\n  \n").contains("no FASTA records"));
    assert!(fasta_err(">\nMK\n").contains("header has no name"));
    // A byte-order mark is not sequence data.
    assert_eq!(fasta::parse("\u{feff}>a\nMK\n", src()).unwrap()[0].sequence, "MK");
}

#[test]
fn fasta_read_names_a_missing_file() {
    let err = fasta::read(Path::new("/no/such/dir/x.fasta")).unwrap_err().to_string();
    assert!(err.starts_with("/no/such/dir/x.fasta: "), "{err}");
}

#[test]
fn a3m_deletions_count_into_the_next_aligned_column() {
    let text = "#6\t1\n>query desc\nMKTAYI\n>hit1/1-9\nMKabTA-I\n>hit2\nM-cT.AYIxyz\n>dup of hit1\nMKTA-I\n>hit3\nmkT AYI\nAK\n";
    let msa = a3m::parse(text, Path::new("q.a3m")).unwrap();
    assert_eq!(msa.sequences, ["MKTAYI", "MKTA-I", "M-TAYI", "TAYIAK"]);
    assert_eq!(msa.descriptions, ["query desc", "hit1/1-9", "hit2", "hit3"]);
    assert_eq!(
        msa.deletion_matrix,
        [vec![0, 0, 0, 0, 0, 0], vec![0, 0, 2, 0, 0, 0], vec![0, 0, 1, 0, 0, 0], vec![2, 0, 0, 0, 0, 0]]
    );
    assert_eq!((msa.len(), msa.width()), (4, 6));
}

#[test]
fn a3m_errors_name_file_row_and_lengths() {
    let err = a3m::parse(">q\nMKTAYI\n>short one\nMKT\n", Path::new("q.a3m")).unwrap_err().to_string();
    assert_eq!(err, "q.a3m: row \"short one\" (line 3) has 3 aligned columns, the query has 6");
    let err = a3m::parse(">q\nMKTAYI\n>h\nMK*AYI\n", Path::new("q.a3m")).unwrap_err().to_string();
    assert!(err.contains("row \"h\" (line 4, character 3): '*' is not an alignment code"), "{err}");
    assert!(a3m::parse("", Path::new("q.a3m")).unwrap_err().to_string().contains("no A3M records"));
    assert!(a3m::parse(">q\nabc\n", Path::new("q.a3m")).unwrap_err().to_string().contains("no aligned residues"));
    let err = a3m::parse("MK\n>q\nMK\n", Path::new("q.a3m")).unwrap_err().to_string();
    assert!(err.contains("line 1: sequence data before the first '>' header"), "{err}");
}

#[test]
fn single_sequence_msa_is_the_query_without_deletions() {
    let msa = a3m::Msa::single("MKT", "q");
    assert_eq!(msa.sequences, ["MKT"]);
    assert_eq!(msa.deletion_matrix, [vec![0, 0, 0]]);
}
