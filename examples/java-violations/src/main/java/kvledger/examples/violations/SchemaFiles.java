package kvledger.examples.violations;

import java.io.IOException;
import java.net.URISyntaxException;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import org.apache.avro.Schema;
import org.apache.avro.SchemaParseException;

/**
 * The violation schema as the project publishes it ({@code schemas/avro/violation.avsc}), read
 * at start so that this program follows the contract in git rather than a copy of it.
 */
record SchemaFiles(Schema reader, List<Schema> writers) {
    private static final Path VIOLATION = Path.of("violation.avsc");
    private static final Path IN_REPO = Path.of("schemas", "avro");

    static SchemaFiles load(Path schemaDir, List<Path> olderWriters) {
        Path dir = schemaDir != null ? schemaDir : locate();
        Schema reader = parse(dir.resolve(VIOLATION));
        List<Schema> writers = new ArrayList<>();
        for (Path file : olderWriters) {
            writers.add(parse(file));
        }
        return new SchemaFiles(reader, List.copyOf(writers));
    }

    /** schemas/avro in the nearest folder above the working directory or this jar that has one. */
    private static Path locate() {
        List<Path> starts = new ArrayList<>(List.of(Path.of("").toAbsolutePath()));
        try {
            starts.add(Path.of(SchemaFiles.class.getProtectionDomain().getCodeSource().getLocation().toURI()));
        } catch (URISyntaxException | SecurityException | NullPointerException e) {
            // Not run from a file: the working directory is the only place to look.
        }
        for (Path start : starts) {
            for (Path dir = start; dir != null; dir = dir.getParent()) {
                if (Files.isRegularFile(dir.resolve(IN_REPO).resolve(VIOLATION))) {
                    return dir.resolve(IN_REPO);
                }
            }
        }
        throw new FatalError("cannot find " + IN_REPO.resolve(VIOLATION) + " above " + starts.get(0)
                + "; pass the project's schemas folder with --schemas DIR");
    }

    private static Schema parse(Path file) {
        try {
            // A parser per file: one parser refuses a second definition of kvledger.Violation.
            return new Schema.Parser().parse(Files.readString(file));
        } catch (NoSuchFileException e) {
            throw new FatalError("no such schema file: " + file);
        } catch (IOException e) {
            throw new FatalError("cannot read schema " + file + ": " + e);
        } catch (SchemaParseException e) {
            throw new FatalError("not an Avro schema: " + file + ": " + e.getMessage());
        }
    }
}
